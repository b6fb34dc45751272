"""bf16 model FLOP utilisation of the FSDP2 training step (used by scripts/gpu_check_worker.py).

A Qwen2 built from a config with random weights (no checkpoint, no tokenizer) trains on long
packed sequences of random token ids; the bf16 matmul peak is measured in the same process.
FLOPs per step count the weights that multiply activations (every parameter but the input
embedding, lm_head included) as ``6 * N * tokens`` plus causal attention, ``6 * L * d_attn * s^2``
per sequence of ``s`` tokens (forward QK^T and PV over half the square, backward twice that);
recomputation is not counted.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

NOMINAL_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16 (no sparsity), SXM datasheet


@dataclass
class MfuShape:
    """Model and batch of the MFU step."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq_len: int
    n_seqs: int
    steps: int
    warmup: int
    peak_n: int  # side of the square bf16 matmul that measures the peak


GPU_SHAPE = MfuShape(
    hidden=2048,
    layers=12,
    heads=16,
    kv_heads=16,
    intermediate=8192,
    vocab=32768,
    seq_len=2048,
    n_seqs=8,
    steps=5,
    warmup=2,
    peak_n=8192,
)
# --cpu dry run: the same code on a model that steps in well under a second.
CPU_SHAPE = MfuShape(
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=4,
    intermediate=256,
    vocab=1024,
    seq_len=128,
    n_seqs=2,
    steps=2,
    warmup=1,
    peak_n=512,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, n: int, iters: int = 20) -> float:
    """Achieved TFLOP/s of an ``n x n x n`` bf16 matmul on random data (mean over ``iters`` after warm-up)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    return 2 * n**3 / seconds / 1e12


def write_model_config(shape: MfuShape, out_dir: str) -> str:
    """A directory with only config.json: the engine builds the model from it (init_from_scratch)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(shape.seq_len, 2048),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="float32",
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    return out_dir


def packed_batch(shape: MfuShape, n_seqs: int, seed: int) -> dict[str, torch.Tensor]:
    """``n_seqs`` full-length rows of random ids (no padding); every token but the first is trained on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (n_seqs, shape.seq_len), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[:, 0] = False
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.int()}


def step_flops(n_matmul_params: int, shape: MfuShape, n_seqs: int) -> float:
    """Model FLOPs of one training step over ``n_seqs`` sequences (see the module docstring)."""
    tokens = n_seqs * shape.seq_len
    d_attn = shape.heads * (shape.hidden // shape.heads)
    attention = 6 * shape.layers * d_attn * shape.seq_len**2 * n_seqs
    return 6.0 * n_matmul_params * tokens + attention


def nominal_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in NOMINAL_BF16_TFLOPS.items() if k in name), None)


def run_mfu(out_dir: str, cpu: bool) -> dict[str, Any]:
    """Measure the peak, then time FSDP2 bf16 training steps of the MFU model; returns the figures."""
    import torch.distributed as dist

    from tandemrl.algorithms.sft import SFTActor
    from tandemrl.api.types import FinetuneSpec
    from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from tandemrl.engines.fsdp import FSDPEngine

    shape = CPU_SHAPE if cpu else GPU_SHAPE
    world = dist.get_world_size()
    cfg_dir = write_model_config(shape, os.path.join(out_dir, "mfu-model"))
    cfg = TrainEngineConfig(
        path=cfg_dir,
        init_from_scratch=True,
        mixed_precision="bfloat16",
        mb_spec=MicroBatchSpec(n_mbs=1),
        optimizer=OptimizerConfig(lr=1e-5, gradient_clipping=1.0),
    )
    engine = FSDPEngine(cfg)
    sft = SFTActor(engine)
    engine.create_process_group()
    device = engine.device
    peak = matmul_peak_tflops(device, shape.peak_n)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=1))
    n_total = sum(p.numel() for p in engine.model.parameters())  # DTensor numel is the global size
    n_embed = engine.model.get_input_embeddings().weight.numel()
    times, losses = [], []
    for step in range(shape.warmup + shape.steps):
        batch = packed_batch(shape, shape.n_seqs, seed=step * world + dist.get_rank())
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(sft.train_lm(batch)["loss"])
        sync(device)
        dist.barrier()
        if step >= shape.warmup:
            times.append(time.perf_counter() - t0)
    sec = sum(times) / len(times)
    flops = step_flops(n_total - n_embed, shape, shape.n_seqs) * world
    achieved = flops / sec / 1e12
    nominal = nominal_peak(device)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    engine.destroy()
    return {
        "shape": asdict(shape),
        "params": n_total,
        "matmul_params": n_total - n_embed,
        "world": world,
        "tokens_per_step": shape.seq_len * shape.n_seqs * world,
        "s_per_step": sec,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu_vs_peak": achieved / peak,
        "nominal_tflops": nominal,
        "mfu_vs_nominal": achieved / nominal if nominal else None,
        "max_mem_gib": mem,
        "losses": losses,
        "device": str(device),
    }


def summary(r: dict[str, Any]) -> str:
    """The CHECK line's text for an MFU result."""
    parts = [
        f"{r['params'] / 1e6:.0f}M params, {r['tokens_per_step']} tok/step ({r['shape']['n_seqs']}x{r['shape']['seq_len']}"
        f" per rank), {r['s_per_step']:.3f} s/step, {r['tokens_per_step'] / r['s_per_step']:.0f} tok/s",
        f"{r['achieved_tflops']:.4g} TFLOP/s achieved",
        f"MFU {100 * r['mfu_vs_peak']:.1f}% of measured bf16 matmul peak {r['peak_tflops']:.4g} TFLOP/s",
    ]
    if r["nominal_tflops"]:
        parts.append(f"{100 * r['mfu_vs_nominal']:.1f}% of {r['nominal_tflops']:.0f} nominal")
    else:
        parts.append("nominal n/a" + (" (CPU dry run)" if r["device"] == "cpu" else ""))
    if r["max_mem_gib"] is not None:
        parts.append(f"max mem {r['max_mem_gib']:.1f} GiB")
    return "; ".join(parts)


if __name__ == "__main__":  # pretty-print a saved result: python scripts/gpu_check_mfu.py OUT/fsdp2_mfu_bf16.json
    import sys

    with open(sys.argv[1]) as f:
        print(summary(json.load(f)["result"]))
