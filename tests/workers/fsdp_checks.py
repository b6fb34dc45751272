"""torchrun worker for the FSDP engine tests: runs one check, writes results to --out."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from prefix_checks import shared_vs_unshared

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.functional import gather_logprobs, next_token_labels

VOCAB = 200
PRECISION_SEEDS = (500, 501, 502, 503, 504)  # bf16 vs fp32: 5 optimizer steps on these batches
PRECISION_LR = 1e-3  # large enough that 5 steps move the loss visibly


def make_batch(seed: int, n: int = 8, max_len: int = 40) -> dict[str, torch.Tensor]:
    """A deterministic padded batch with varied lengths and a prompt/answer loss mask."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, max_len + 1, (n,), generator=g)
    ids = torch.randint(0, VOCAB, (n, max_len), generator=g)
    am = torch.arange(max_len)[None, :] < lens[:, None]
    prompt = torch.randint(1, 5, (n,), generator=g)
    lm = am & (torch.arange(max_len)[None, :] >= prompt[:, None])
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm.int()}


def rank_slice(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of a global batch."""
    r, w = dist.get_rank(), dist.get_world_size()
    n = batch["input_ids"].shape[0] // w
    return {k: v[r * n : (r + 1) * n] for k, v in batch.items()}


def next_token_logp(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return gather_logprobs(logits, next_token_labels(mb["input_ids"], mb["cu_seqlens"]))


def optimizer_dtypes(e: Any) -> list[str]:
    """Dtypes of the tensors the optimizer updates and of its Adam moments (the master weights)."""
    opt = getattr(e.optimizer, "optimizer", e.optimizer)  # megatron wraps a torch optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    zero = getattr(e.model, "optimizer", None)  # DeepSpeed's ZeRO optimizer keeps its own fp32 partitions
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        params += list(getattr(zero, attr, []))
    moments = [v for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    return sorted({str(t.dtype) for t in params + moments})


def precision_run(e: Any) -> dict[str, Any]:
    """5 SFT steps of a built engine on the precision batches (then destroyed): losses and the dtypes of
    log-probs, exported weights and optimizer tensors."""
    lm = SFTActor(e)
    losses = [lm.train_lm(rank_slice(make_batch(seed)))["loss"] for seed in PRECISION_SEEDS]
    out = {
        "losses": losses,
        "logp_dtype": str(e.forward(make_batch(999, n=4), post_hook=next_token_logp).dtype),
        "export_dtypes": sorted({s.dtype for s in e.hf_param_specs()}),
        "optimizer_dtypes": optimizer_dtypes(e),
    }
    e.destroy()
    return out


def bf16_vs_fp32(build: Callable[[str | None], Any]) -> dict[str, dict[str, Any]]:
    """``precision_run`` of ``build(mixed_precision)`` computing in fp32 and in bf16, from the same weights."""
    return {"fp32": precision_run(build(None)), "bf16": precision_run(build("bfloat16"))}


def engine(model: str, mb: MicroBatchSpec, lr: float = 1e-4, mixed_precision: str | None = None) -> FSDPEngine:
    """An FSDP engine computing in fp32 unless ``mixed_precision`` says otherwise."""
    opt = OptimizerConfig(lr=lr, gradient_clipping=1.0)
    cfg = TrainEngineConfig(path=model, mb_spec=mb, mixed_precision=mixed_precision, optimizer=opt)
    e = FSDPEngine(cfg)
    e.create_process_group()
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=10))
    return e


def invariance(args: argparse.Namespace) -> None:
    """Two optimizer steps for each micro-batch spec; params and grad norms per spec."""
    specs = {
        "mb1": MicroBatchSpec(n_mbs=1),
        "mb4": MicroBatchSpec(n_mbs=4),
        "tok48": MicroBatchSpec(max_tokens_per_mb=48),
    }
    result = {}
    for tag, spec in specs.items():
        e = engine(args.model, spec)
        norms, losses = [], []
        for step in range(2):
            stats = SFTActor(e).train_lm(rank_slice(make_batch(100 + step)))
            norms.append(stats["grad_norm"])
            losses.append(stats["loss"])
        sd = e.full_state_dict()
        result[tag] = {"params": sd, "grad_norms": norms, "losses": losses, "n_mbs": stats["n_mbs"]}
        e.destroy()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(args.out, f"invariance_w{dist.get_world_size()}.pt"))


def checkpoint(args: argparse.Namespace) -> None:
    """Train, export HF + DCP, then record the next three losses and the engine's logits."""
    e = engine(args.model, MicroBatchSpec(n_mbs=2))
    for step in range(2):
        SFTActor(e).train_lm(rank_slice(make_batch(200 + step)))
    e.set_version(2)
    e.save(SaveLoadMeta(path=os.path.join(args.out, "hf"), weight_format="hf", tokenizer_path=args.tokenizer))
    e.save(SaveLoadMeta(path=os.path.join(args.out, "dcp"), weight_format="dcp", with_optim=True))
    probe = make_batch(999, n=4)
    logits = e.forward(probe)
    losses = []
    for step in range(3):
        losses.append(SFTActor(e).train_lm(rank_slice(make_batch(300 + step)))["loss"])
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "logits": logits, "probe": probe}, os.path.join(args.out, "continued.pt"))


def variants(args: argparse.Namespace) -> None:
    """Gradient checkpointing, bf16 mixed precision against fp32, the NaN-gradient guard and prefix sharing."""
    init_default_process_group()
    batch = rank_slice(make_batch(400))
    out: dict[str, Any] = {}
    for tag, extra in {"plain": {}, "ckpt": {"gradient_checkpointing": True}}.items():
        cfg = TrainEngineConfig(path=args.model, mixed_precision=None, optimizer=OptimizerConfig(lr=1e-4), **extra)
        e = FSDPEngine(cfg)
        e.create_process_group()
        e.initialize(None, None)
        stats = SFTActor(e).train_lm(batch)
        out[tag] = {"stats": stats, "params": e.full_state_dict()}
        e.destroy()
    out["precision"] = bf16_vs_fp32(lambda mixed: engine(args.model, MicroBatchSpec(n_mbs=2), PRECISION_LR, mixed))
    e = engine(args.model, MicroBatchSpec())
    before = e.full_state_dict()

    def nan_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return logits.float().mean() * float("nan")

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tandemrl.engines.base").addHandler(handler)
    out["nan"] = {
        "stats": e.train_batch(batch, nan_loss, lambda mb: 1.0),
        "before": before,
        "after": e.full_state_dict(),
    }
    e.export_stats()
    # No trainable token on any rank (e.g. mask_no_eos with every response truncated): skipped, not raised.
    out["empty"] = {"stats": e.train_batch(batch, nan_loss, lambda mb: 0.0), "exported": e.export_stats()}
    out["empty"]["after"] = e.full_state_dict()
    out["warned"] = list(warned)
    logging.getLogger("tandemrl.engines.base").removeHandler(handler)
    out["prefix"] = shared_vs_unshared(FSDPEngine, args.model)
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(args.out, "variants.pt"))


def resume(args: argparse.Namespace) -> None:
    """Fresh process: load the DCP checkpoint and replay the same three steps."""
    e = engine(args.model, MicroBatchSpec(n_mbs=2))
    e.load(SaveLoadMeta(path=os.path.join(args.out, "dcp"), weight_format="dcp", with_optim=True))
    assert e.get_version() == 2, e.get_version()
    losses = []
    for step in range(3):
        losses.append(SFTActor(e).train_lm(rank_slice(make_batch(300 + step)))["loss"])
    if dist.get_rank() == 0:
        torch.save({"losses": losses}, os.path.join(args.out, "resumed.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["invariance", "checkpoint", "resume", "variants"])
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    {"invariance": invariance, "checkpoint": checkpoint, "resume": resume, "variants": variants}[a.mode](a)
    destroy_process_groups()
