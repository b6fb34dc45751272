"""LoRA vs full fine-tuning on one FSDP2 engine each: train step time and bytes per weight update.

Both engines load the same model and train on the same synthetic batches, interleaved step by
step so machine load hits both alike. A "weight update" is what the disk push writes: the full
HF safetensors for full fine-tuning, the PEFT adapter for LoRA (docs/lora.md). The load average
is printed before and after, since the figures are only comparable on an equally loaded machine.
Figures are printed, never asserted.

    OMP_NUM_THREADS=2 python bench/lora.py
    python bench/lora.py --model /path/to/hf_dir --rank 16 --steps 10
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile
import time

import torch

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.engine import LoRAConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.utils.cli import ArgumentParser

DEFAULT_MODEL = os.path.expanduser("~/.cache/tandemrl/tiny-models/qwen2-3f858009712df2d8")  # 25M Qwen2


def build(model: str, rank: int) -> FSDPEngine:
    cfg = TrainEngineConfig(
        path=model,
        mb_spec=MicroBatchSpec(n_mbs=1),
        optimizer=OptimizerConfig(lr=1e-4),
        lora=LoRAConfig(rank=rank, alpha=2.0 * rank),
    )
    e = FSDPEngine(cfg)
    e.create_process_group()
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=1))
    return e


def batch(vocab: int, seed: int, rows: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids, dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": am.int()}


def update_bytes(e: FSDPEngine, fmt: str) -> tuple[int, float]:
    """(bytes, seconds) of one disk weight update's files in ``fmt`` ("hf" or "peft")."""
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        e.save(SaveLoadMeta(path=d, weight_format=fmt))
        seconds = time.perf_counter() - start
        return sum(os.path.getsize(f) for f in glob.glob(os.path.join(d, "*.safetensors"))), seconds


def main(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()}  (threads {torch.get_num_threads()}, {os.cpu_count()} cores)")
    engines = {"full": build(args.model, 0), f"lora r={args.rank}": build(args.model, args.rank)}
    vocab = int(next(iter(engines.values())).model_config.vocab_size)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for step in range(args.warmup + args.steps):
        b = batch(vocab, step, args.rows, args.length)
        for name, e in engines.items():
            start = time.perf_counter()
            SFTActor(e).train_lm(b)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for name, e in engines.items():
        trainable = sum(p.numel() for p in e.model.parameters() if p.requires_grad)
        n_bytes, seconds = update_bytes(e, "peft" if e.lora_rank else "hf")
        print(
            f"{name:>10}: step {statistics.median(times[name]):.3f}s (median of {args.steps}), "
            f"trainable {trainable / 1e6:.2f}M params, update {n_bytes / 1e6:.2f} MB written in {seconds:.2f}s"
        )
    print(f"load average after: {os.getloadavg()}")
    for e in engines.values():
        e.destroy()


if __name__ == "__main__":
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory (default: the cached 25M tiny Qwen2)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--rows", type=int, default=8, help="sequences per batch")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    from tandemrl.utils.machine import measured_on

    try:
        with measured_on("lora"):
            main(p.parse_args())
    finally:
        destroy_process_groups()
