"""torchrun worker for the Megatron engine tests (2 ranks). Modes:

``train``: a DP=2 engine (distributed optimizer) and a twin with another micro-batch split take the
same first step; the first then steps once more, saves a recoverable checkpoint and continues 3
steps. A TP=2 engine exports HF weights and its logits on a probe batch; a PP=2 engine reports its
stats on every stage. With ``--moe``, the same
3 SFT steps on the tiny MoE model at EP=1 and EP=2.
``resume`` (a fresh process): load the checkpoint and replay the 3 continued steps.
Rank 0 writes ``<mode>.pt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from fsdp_checks import make_batch
from parity_checks import dp_slice

from tandemrl.actors.megatron import MegatronLMEngine
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.types import FinetuneSpec, SaveLoadMeta
from tandemrl.utils.allocation import AllocationMode

FIRST_SEED = 100
CONTINUED_SEEDS = (300, 301, 302)
TOTAL_STEPS = 10  # linear LR decay over these, so a resumed schedule shows in the losses


def engine(allocation: str, model: str, n_mbs: int = 2) -> MegatronLMEngine:
    cfg = TrainEngineConfig(
        path=model,
        mb_spec=MicroBatchSpec(n_mbs=n_mbs),
        optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=1.0, lr_scheduler_type="linear"),
    )
    e = MegatronLMEngine(cfg)
    e.create_process_group(AllocationMode.from_str(allocation).train.strategy)
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=TOTAL_STEPS, train_batch_size=1))
    return e


def step(e: MegatronLMEngine, seed: int) -> dict[str, float]:
    stats = e.train_lm(dp_slice(e, make_batch(seed)))
    e.step_lr_scheduler()
    return stats


def train() -> None:
    init_default_process_group()
    out: dict[str, Any] = {}
    a = engine("megatron:d2", ARGS.model, n_mbs=1)
    b = engine("megatron:d2", ARGS.model, n_mbs=3)
    out["split"] = [step(a, FIRST_SEED), step(b, FIRST_SEED)]
    b.destroy()
    step(a, FIRST_SEED + 1)
    a.set_version(2)
    a.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt"), weight_format="dcp", with_optim=True))
    out["continued"] = [step(a, seed) for seed in CONTINUED_SEEDS]
    a.destroy()

    t = engine("megatron:t2", ARGS.model)
    step(t, FIRST_SEED)
    t.save(SaveLoadMeta(path=os.path.join(ARGS.out, "hf"), weight_format="hf", tokenizer_path=ARGS.model))
    out["probe"] = make_batch(999, n=4)
    out["logits"] = t.forward(out["probe"])
    out["specs"] = t.hf_param_specs()
    out["names"] = [name for name, _ in t.iter_hf_params()]
    t.destroy()

    # Pipeline stages: rank 0 (first stage) must report the stats the loss function recorded on rank 1.
    pp = engine("megatron:p2", ARGS.model)
    out["pp_eval"] = pp.evaluate_lm(dp_slice(pp, make_batch(FIRST_SEED)))  # weights before the step
    pp.export_stats()  # drop what earlier engines recorded
    out["pp_step"] = step(pp, FIRST_SEED)
    out["pp_stats"] = pp.export_stats()
    pp.destroy()

    if ARGS.moe:
        out["moe"] = {}
        for alloc in ("megatron:d2", "megatron:d2e2"):
            m = engine(alloc, ARGS.moe)
            out["moe"][alloc] = [step(m, seed) for seed in (200, 201, 202)]
            m.destroy()
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(ARGS.out, "train.pt"))


def resume() -> None:
    init_default_process_group()
    e = engine("megatron:d2", ARGS.model, n_mbs=1)
    e.load(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt"), weight_format="dcp", with_optim=True))
    out = {"version": e.get_version(), "continued": [step(e, seed) for seed in CONTINUED_SEEDS]}
    e.destroy()
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(ARGS.out, "resume.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--model", required=True)
    p.add_argument("--moe", default="", help="tiny MoE model dir: also compare EP=1 with EP=2")
    p.add_argument("--out", required=True)
    ARGS = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    {"train": train, "resume": resume}[ARGS.mode]()
    dist.destroy_process_group()
