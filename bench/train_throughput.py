"""Training throughput: packed micro-batches vs a right-padded baseline, or fp32 vs bf16 compute.

``--compare padding`` (the default, FSDP only) is described here; ``--compare precision``
trains two packed engines of ``--backend`` (fsdp, deepspeed or megatron) interleaved the same
way, one computing in fp32 (``mixed_precision=null``) and one in bf16 over fp32 master weights
(``mixed_precision=bfloat16``), and prints both step times and the largest loss gap.

The engine packs each batch into 1-D micro-batches (no pad tokens; ``position_ids``
restart per sequence). This measures what that buys on real GSM8K SFT lengths: the same
model and optimizer also train on the right-padded [B, L] batch with an attention mask,
in the same process, on the same batches, interleaved step by step so machine noise
hits both alike. Both engines start from the same weights and see the same batches, so
their losses should agree; the largest gap is printed as a check that the baseline
computes the same masked next-token loss.

Every method also gets its MFU: the step's matmul FLOPs over the bf16 matmul peak all ranks
measure together in the same run (``bench/mfu.py``).

Figures are printed, never asserted. Rank 0 prints.

    OMP_NUM_THREADS=2 python bench/train_throughput.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/train_throughput.py
    python bench/train_throughput.py --hidden 256 --layers 4 --steps 5
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/train_throughput.py \
        --compare precision --backend deepspeed

Set OMP_NUM_THREADS to the cores per process (cores / nproc_per_node): torch's default
under torchrun is 1 thread per process, and more threads than cores makes ranks
oversubscribe the CPU and time mostly contention.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, TensorDict
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import BaseTrainEngine
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.registry import make_engine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.functional import gather_logprobs
from tandemrl.utils.cli import ArgumentParser

try:  # run as a script (python bench/train_throughput.py): bench/ is on sys.path
    from mfu import bf16_peak_flops, matmul_params, train_flops
except ImportError:  # imported as bench.train_throughput
    from bench.mfu import bf16_peak_flops, matmul_params, train_flops

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
HEAD_DIM = 32  # the tiny-model recipe's head size


class PaddedLM(SFTActor):
    """The baseline: SFT on the whole right-padded [B, L] batch in one forward/backward (FSDP engine internals)."""

    def __init__(self, engine: FSDPEngine):
        super().__init__(engine)
        self.fsdp = engine

    def train_lm(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on the padded batch; same loss and DP scaling as the packed path."""
        e = self.fsdp
        e.train()
        mb = e._to_device(batch)
        ids, am = mb["input_ids"], mb["attention_mask"].bool()
        logits = e.model(input_ids=ids, attention_mask=am.long(), use_cache=False).logits
        # Position t predicts token t+1; pad positions have loss_mask 0.
        mask = mb["loss_mask"][:, 1:].bool() & am[:, 1:]
        logp = gather_logprobs(logits[:, :-1], ids[:, 1:])
        total = e._all_reduce_sum(float(mask.sum()))
        loss_sum = -(logp * mask).sum()
        # FSDP averages gradients over DP ranks, hence the world-size factor (as in train_batch).
        e._backward(loss_sum * (e.data_parallel_world_size / total))
        grad_norm, stepped = e._optimizer_step()
        return {"loss": e._all_reduce_sum(float(loss_sum.detach())) / total, "grad_norm": grad_norm}


@dataclass
class Timing:
    """Accumulated wall time and losses of one method over the timed steps."""

    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K dir with train.jsonl.")
    ap.add_argument("--split", default="train")
    ap.add_argument("--model", default=None, help="HF model dir; default: the cached tiny Qwen2.")
    ap.add_argument("--hidden", type=int, default=128, help="Tiny model hidden size (multiple of 64).")
    ap.add_argument("--layers", type=int, default=2, help="Tiny model layers.")
    ap.add_argument("--batch-size", type=int, default=32, help="Global batch (sequences per step).")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed steps per method.")
    ap.add_argument("--steps", type=int, default=5, help="Timed steps per method.")
    ap.add_argument(
        "--max-tokens-per-mb", type=int, default=None, help="Packed path token budget per micro-batch (default: one)."
    )
    ap.add_argument("--max-length", type=int, default=None, help="Drop samples longer than this many tokens.")
    ap.add_argument(
        "--compare",
        choices=["padding", "precision"],
        default="padding",
        help="padding: packed vs right-padded (fsdp); precision: fp32 vs bf16 compute, both packed.",
    )
    ap.add_argument("--backend", choices=["fsdp", "deepspeed", "megatron"], default="fsdp")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "fp32"],
        default="bfloat16",
        help="--compare padding: compute dtype of both engines (bf16 over fp32 master weights, or fp32).",
    )
    a = ap.parse_args(argv)
    if a.compare == "padding" and a.backend != "fsdp":
        ap.error("--compare padding measures the FSDP engine only; use --backend fsdp")
    for name in ("batch_size", "steps", "layers"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be positive")
    if a.warmup < 0:
        ap.error(f"--warmup={a.warmup} must be >= 0")
    if a.hidden <= 0 or a.hidden % (2 * HEAD_DIM):
        ap.error(f"--hidden={a.hidden} must be a positive multiple of {2 * HEAD_DIM}")
    if not (Path(a.data) / f"{a.split}.jsonl").is_file():
        ap.error(f"--data: {Path(a.data) / f'{a.split}.jsonl'} not found")
    return a


def cache_dir() -> Path:
    """Same tiny-model cache as the tests: ${TANDEMRL_CACHE:-~/.cache/tandemrl}/tiny-models."""
    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    return Path(root).expanduser() / "tiny-models"


def resolve_model(a: argparse.Namespace) -> str:
    if a.model:
        if not os.path.isdir(a.model):
            raise SystemExit(f"--model: directory not found: {a.model}")
        return a.model
    from tandemrl.models.make_tiny import ensure_tiny_model

    heads = a.hidden // HEAD_DIM
    return ensure_tiny_model(
        cache_dir(),
        "qwen2",
        corpus_path=a.data,
        hidden=a.hidden,
        layers=a.layers,
        heads=heads,
        intermediate=2 * a.hidden,
    )


def load_batches(a: argparse.Namespace, model: str, rank: int, world: int) -> list[TensorDict]:
    """This rank's padded batches: real GSM8K SFT samples tokenized with the model's tokenizer."""
    from transformers import AutoTokenizer

    from tandemrl.data.gsm8k import get_gsm8k_sft_dataset
    from tandemrl.data.loader import pad_sequences_to_tensors

    if a.batch_size % world:
        raise SystemExit(f"--batch-size={a.batch_size} must be a multiple of the world size {world}")
    per_rank = a.batch_size // world
    n_steps = a.warmup + a.steps
    tok = AutoTokenizer.from_pretrained(model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    # GSM8K rows come in no particular order, so the first rows are a fair sample of its
    # lengths; tokenizing only those keeps start-up short (all rows if some get filtered).
    rows_needed = n_steps * a.batch_size if a.max_length is None else None
    ds = get_gsm8k_sft_dataset(a.data, a.split, tok, rank, world, max_length=a.max_length, max_samples=rows_needed)
    if len(ds) < n_steps * per_rank:
        raise SystemExit(f"--data: {len(ds)} samples per rank, need {n_steps * per_rank} for {n_steps} steps")
    ds = ds.select(range(n_steps * per_rank))
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in ds]
    return [pad_sequences_to_tensors(rows[i * per_rank : (i + 1) * per_rank], pad_id) for i in range(n_steps)]


def build_engine(
    model: str, a: argparse.Namespace, n_steps: int, mixed_precision: str | None = "bfloat16"
) -> BaseTrainEngine:
    cfg = TrainEngineConfig(
        path=model,
        mixed_precision=mixed_precision,
        mb_spec=MicroBatchSpec(n_mbs=1, max_tokens_per_mb=a.max_tokens_per_mb),
        optimizer=OptimizerConfig(lr=1e-4, gradient_clipping=1.0),
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    e = make_engine(a.backend, cfg)
    e.create_process_group(parse_allocation(f"{a.backend}:d{world}").train.strategy)
    e.initialize(
        None, FinetuneSpec(total_train_epochs=1, dataset_size=n_steps * a.batch_size, train_batch_size=a.batch_size)
    )
    return e


def build_methods(model: str, a: argparse.Namespace, n_steps: int) -> dict[str, SFTActor]:
    """The two interleaved methods of ``--compare``, by name."""
    if a.compare == "precision":
        return {
            "fp32": SFTActor(build_engine(model, a, n_steps, mixed_precision=None)),
            "bf16": SFTActor(build_engine(model, a, n_steps, mixed_precision="bfloat16")),
        }
    precision = None if a.dtype == "fp32" else a.dtype
    packed, padded = (build_engine(model, a, n_steps, mixed_precision=precision) for _ in range(2))
    return {"packed": SFTActor(packed), "padded": PaddedLM(padded)}


def sync(device: torch.device) -> None:
    """Wait for queued device work and for every rank, so a timer covers the whole step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed_step(method: SFTActor, batch: TensorDict) -> tuple[float, float]:
    sync(method.engine.device)
    t0 = time.perf_counter()
    stats = method.train_lm(batch)
    sync(method.engine.device)
    return time.perf_counter() - t0, stats["loss"]


def global_sum(value: int) -> int:
    t = torch.tensor(value, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return int(t.item())


def all_lengths(batches: list[TensorDict]) -> list[int]:
    """Sequence lengths of these batches on every rank (for the length summary)."""
    mine = [int(n) for b in batches for n in b["attention_mask"].sum(1)]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    parts: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return [n for part in parts for n in (part or [])]


def run(a: argparse.Namespace) -> None:
    from tandemrl.engines.base import init_default_process_group

    init_default_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = resolve_model(a) if rank == 0 else None
    if world > 1:  # rank 0 builds the tiny model once; the others reuse its path
        box = [model]
        dist.broadcast_object_list(box, src=0)
        model = box[0]
    batches = load_batches(a, model, rank, world)
    n_steps = a.warmup + a.steps
    methods = build_methods(model, a, n_steps)
    timings = {name: Timing() for name in methods}
    order = list(methods)
    for step, batch in enumerate(batches):
        # Alternate which method goes first so neither always inherits the other's cache state.
        for name in order if step % 2 == 0 else order[::-1]:
            secs, loss = timed_step(methods[name], batch)
            timings[name].losses.append(loss)
            if step >= a.warmup:
                timings[name].seconds += secs

    timed = batches[a.warmup :]
    real = global_sum(sum(int(b["attention_mask"].sum()) for b in timed))
    slots = global_sum(sum(b["attention_mask"].numel() for b in timed))
    lengths = all_lengths(timed)
    lens = torch.tensor(lengths, dtype=torch.float32)
    first = methods[order[0]].engine
    peak = bf16_peak_flops(first.device)
    if rank == 0:
        cfg = first.model_config
        attn_dim = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        n_mm = matmul_params(cfg, n_parameters(first))
        flops = train_flops(n_mm, lengths, cfg.num_hidden_layers, attn_dim)
        report(a, model, first, timings, real, slots, lens, world)
        print(f"\nbf16 matmul peak (all ranks, measured now): {peak / 1e12:.3f} TFLOP/s")
        for name, t in timings.items():
            achieved = flops / max(t.seconds, 1e-9)
            print(f"MFU {name}: {achieved / 1e12:.3f} TFLOP/s = {100 * achieved / peak:.1f}% of the bf16 peak")


def n_parameters(engine: BaseTrainEngine) -> int:
    """Unsharded parameter count (a tied LM head counted once)."""
    tied = getattr(engine.model_config, "tie_word_embeddings", False)
    return sum(math.prod(s.shape) for s in engine.hf_param_specs() if not (tied and s.name == "lm_head.weight"))


def report(
    a: argparse.Namespace,
    model: str,
    engine: BaseTrainEngine,
    timings: dict[str, Timing],
    real: int,
    slots: int,
    lens: torch.Tensor,
    world: int,
) -> None:
    cfg = engine.model_config
    first, second = timings
    n_steps = a.warmup + a.steps
    gap = max(abs(x - y) for x, y in zip(timings[first].losses, timings[second].losses, strict=True))
    print(
        f"model: {model}\n"
        f"  hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} vocab={cfg.vocab_size} "
        f"params~{n_parameters(engine) / 1e6:.2f}M attn={engine.config.attn_impl} device={engine.device.type} "
        f"backend={a.backend}\n"
        f"world={world} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
        f"torch_threads={torch.get_num_threads()} batch={a.batch_size} warmup={a.warmup} steps={a.steps} "
        f"max_tokens_per_mb={a.max_tokens_per_mb} load_avg={os.getloadavg()[0]:.1f}\n"
        f"GSM8K lengths (timed batches): mean={lens.mean():.0f} max={lens.max():.0f} min={lens.min():.0f}; "
        f"padded-token fraction={1 - real / slots:.3f}\n"
    )
    print(f"{'method':<8} {'tokens/s (non-pad)':>19} {'ms/step':>9} {'pad frac':>9} {'final loss':>11}")
    rates = {}
    for name, t in timings.items():
        rates[name] = real / t.seconds
        frac = 1 - real / slots if name == "padded" else 0.0
        ms = 1000 * t.seconds / a.steps
        print(f"{name:<8} {rates[name]:>19.0f} {ms:>9.1f} {frac:>9.3f} {t.losses[-1]:>11.4f}")
    # The speed-up of the engine's path over the baseline: packed over padded, bf16 over fp32.
    fast, base = ("packed", "padded") if "packed" in rates else ("bf16", "fp32")
    print(f"\nspeed-up {fast}/{base}: {rates[fast] / rates[base]:.2f}x")
    print(f"max |loss_{first} - loss_{second}| over {n_steps} steps: {gap:.2e}")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    try:
        run(a)
    finally:
        if dist.is_initialized():
            destroy_process_groups()


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("train_throughput"):
        main()
