"""torchrun worker for the Megatron engine tests (2 ranks). Modes:

``train``: a DP=2 engine (distributed optimizer) and a twin with another micro-batch split take the
same first step; the first then steps once more, saves a recoverable checkpoint and continues 3
steps. A TP=2 engine exports HF weights and its logits on a probe batch; a PP=2 engine reports its
stats on every stage. A DP=2 engine with the plain (non-distributed) optimizer saves and continues
like the first. With ``--moe``, the same 3 SFT steps on the tiny MoE model at EP=1 and EP=2 (EP=2
saves after its first).
``resume`` (a fresh process): load the checkpoint and replay the 3 continued steps at DP=2, then
reshard it: load it at TP=2 and at PP=2 (one engine after the other) and replay them again; the
plain-optimizer checkpoint is loaded at PP=2 with the plain optimizer too, the EP=2 MoE one at EP=1.
Then the errors for a checkpoint without its dist checkpoint and for the other optimizer kind, and a
checkpoint saved before any step (DP=2), loaded at TP=2 to replay the first DP=2 engine's two steps.
Rank 0 writes ``<mode>.pt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from fsdp_checks import bf16_vs_fp32, make_batch
from parity_checks import dp_slice

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.megatron.checkpoint import CKPT_SUBDIR
from tandemrl.engines.megatron.engine import MegatronEngine
from tandemrl.engines.teardown import destroy_process_groups

FIRST_SEED = 100
CONTINUED_SEEDS = (300, 301, 302)
MOE_SEEDS = (200, 201, 202)
TOTAL_STEPS = 10  # linear LR decay over these, so a resumed schedule shows in the losses


def engine(
    allocation: str, model: str, n_mbs: int = 2, dist_opt: bool = True, mixed_precision: str | None = None
) -> MegatronEngine:
    """A Megatron engine computing in fp32 unless ``mixed_precision`` says otherwise."""
    cfg = TrainEngineConfig(
        path=model,
        mixed_precision=mixed_precision,
        mb_spec=MicroBatchSpec(n_mbs=n_mbs),
        optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=1.0, lr_scheduler_type="linear"),
    )
    cfg.megatron.use_distributed_optimizer = dist_opt
    e = MegatronEngine(cfg)
    e.create_process_group(parse_allocation(allocation).train.strategy)
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=TOTAL_STEPS, train_batch_size=1))
    return e


def step(e: MegatronEngine, seed: int) -> dict[str, float]:
    return SFTActor(e).train_lm(dp_slice(e, make_batch(seed)))


def train() -> None:
    init_default_process_group()
    out: dict[str, Any] = {}
    a = engine("megatron:d2", ARGS.model, n_mbs=1)
    b = engine("megatron:d2", ARGS.model, n_mbs=3)
    out["split"] = [step(a, FIRST_SEED), step(b, FIRST_SEED)]
    b.destroy()
    out["second"] = step(a, FIRST_SEED + 1)
    a.set_version(2)
    out["saved_weights"] = a.full_state_dict()  # HF-named, on rank 0: what a resharded load must restore
    a.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt"), weight_format="dcp", with_optim=True))
    out["continued"] = [step(a, seed) for seed in CONTINUED_SEEDS]
    a.destroy()

    c = engine("megatron:d2", ARGS.model, n_mbs=1, dist_opt=False)
    step(c, FIRST_SEED)
    step(c, FIRST_SEED + 1)
    c.set_version(2)
    out["saved_weights_plain"] = c.full_state_dict()
    c.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt_plain"), weight_format="dcp", with_optim=True))
    out["continued_plain"] = [step(c, seed) for seed in CONTINUED_SEEDS]
    c.destroy()

    # bf16 compute over fp32 main params and Adam state in the optimizer: tracks fp32 over 5 steps, and
    # its state saves and comes back.
    out["precision"] = bf16_vs_fp32(lambda mixed: engine("megatron:d2", ARGS.model, mixed_precision=mixed))
    h = engine("megatron:d2", ARGS.model, n_mbs=1, mixed_precision="bfloat16")
    step(h, FIRST_SEED)
    h.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt_bf16"), weight_format="dcp", with_optim=True))
    out["continued_bf16"] = [step(h, seed) for seed in CONTINUED_SEEDS]
    h.destroy()

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
    out["pp_eval"] = SFTActor(pp).evaluate_lm(dp_slice(pp, make_batch(FIRST_SEED)))  # weights before the step
    pp.export_stats()  # drop what earlier engines recorded
    out["pp_step"] = step(pp, FIRST_SEED)
    out["pp_stats"] = pp.export_stats()
    pp.destroy()

    if ARGS.moe:
        out["moe"] = {}
        for alloc in ("megatron:d2", "megatron:d2e2"):
            m = engine(alloc, ARGS.moe)
            out["moe"][alloc] = [step(m, MOE_SEEDS[0])]
            if alloc == "megatron:d2e2":  # experts sharded, and in their own chained optimizer
                m.set_version(1)
                out["saved_weights_moe"] = m.full_state_dict()
                m.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt_moe"), weight_format="dcp", with_optim=True))
            out["moe"][alloc] += [step(m, seed) for seed in MOE_SEEDS[1:]]
            m.destroy()
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(ARGS.out, "train.pt"))


def resumed(
    allocation: str,
    ckpt: str,
    dist_opt: bool = True,
    model: str = "",
    n_mbs: int = 1,
    seeds: tuple = CONTINUED_SEEDS,
    mixed_precision: str | None = None,
) -> dict[str, Any]:
    """Load ``ckpt`` into a fresh engine at ``allocation`` and replay the continued steps."""
    e = engine(allocation, model or ARGS.model, n_mbs=n_mbs, dist_opt=dist_opt, mixed_precision=mixed_precision)
    e.load(SaveLoadMeta(path=os.path.join(ARGS.out, ckpt), weight_format="dcp", with_optim=True))
    res = {"version": e.get_version(), "weights": e.full_state_dict()}
    res["continued"] = [step(e, seed) for seed in seeds]
    e.destroy()
    return res


def resume() -> None:
    init_default_process_group()
    out = {alloc: resumed(alloc, "ckpt") for alloc in ("megatron:d2", "megatron:t2", "megatron:p2")}
    out["plain"] = resumed("megatron:p2", "ckpt_plain", dist_opt=False)
    out["bf16"] = resumed("megatron:d2", "ckpt_bf16", mixed_precision="bfloat16")
    if ARGS.moe:
        out["moe"] = resumed("megatron:d2", "ckpt_moe", model=ARGS.moe, n_mbs=2, seeds=MOE_SEEDS[1:])
    # A checkpoint whose engine files exist but whose dist checkpoint is gone: one clear error.
    broken = os.path.join(ARGS.out, "broken")
    if dist.get_rank() == 0:
        shutil.copytree(
            os.path.join(ARGS.out, "ckpt"), broken, ignore=shutil.ignore_patterns(CKPT_SUBDIR), dirs_exist_ok=True
        )
    dist.barrier()
    e = engine("megatron:d2", ARGS.model, n_mbs=1)
    try:
        e.load(SaveLoadMeta(path=broken, weight_format="dcp", with_optim=True))
    except FileNotFoundError as err:
        out["broken_error"] = str(err)
    try:  # optimizer state of the other kind: its structure differs, so it is refused up front
        e.load(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt_plain"), weight_format="dcp", with_optim=True))
    except ValueError as err:
        out["optimizer_kind_error"] = str(err)
    # Neither load touched the engine: a save before any step (empty Adam state) must work too.
    out["fresh_weights"] = e.full_state_dict()
    e.save(SaveLoadMeta(path=os.path.join(ARGS.out, "ckpt_fresh"), weight_format="dcp", with_optim=True))
    e.destroy()
    out["fresh"] = resumed("megatron:t2", "ckpt_fresh", seeds=(FIRST_SEED, FIRST_SEED + 1))  # replays `a`
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
    destroy_process_groups()
