"""Model FLOPs utilisation of a training step: the step's matmul FLOPs over the bf16 matmul peak
measured on the same ranks in the same run.

FLOPs of one training step (forward + backward = 3 forwards) on packed sequences of lengths s_i:

* dense matmuls: ``6 * N * T`` with ``T = sum(s_i)`` and ``N`` the parameters that multiply
  (every weight matrix, the LM head included; the input embedding is a lookup and is left out);
* attention scores and values: per layer and sequence ``4 * s_i^2 * d_attn`` forward (QK^T and
  AV, each ``2 s^2 d``), halved for the causal mask, times 3 for training: ``6 * s_i^2 * d_attn``.

The peak: every rank times the same bf16 ``[n, n] @ [n, n]`` matmul at once (its own threads),
after a barrier, so the ranks share the cores as they do when training; the peak of the run is
the sum over ranks. Figures only; nothing asserts them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist


def train_flops(n_matmul_params: int, lengths: Iterable[int], layers: int, attn_dim: int) -> float:
    """Matmul FLOPs of one training step over sequences of ``lengths`` (see the module docstring)."""
    lens = list(lengths)
    tokens = sum(lens)
    return 6.0 * n_matmul_params * tokens + 6.0 * layers * attn_dim * sum(s * s for s in lens)


def matmul_params(model_config, n_params: int) -> int:
    """Parameters that take part in matmuls: all but the input embedding (a tied head still multiplies)."""
    embed = model_config.vocab_size * model_config.hidden_size
    tied = getattr(model_config, "tie_word_embeddings", False)
    return n_params - embed + (embed if tied else 0)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def bf16_peak_flops(device: torch.device, n: int = 2048, seconds: float = 2.0) -> float:
    """bf16 matmul FLOP/s of all ranks together, measured now (a collective when distributed)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):  # warm-up: kernel selection, page faults
        a @ b
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    _sync(device)
    mine = torch.tensor(2.0 * n**3 * reps / (time.perf_counter() - t0), dtype=torch.float64)
    if _world() > 1:
        mine = mine.to(device) if device.type == "cuda" else mine
        dist.all_reduce(mine)
    return float(mine.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if _world() > 1:
        dist.barrier()
