"""torchrun worker for the DeepSpeed engine tests (2 ranks). Two modes, one engine per ZeRO stage each:

``train``: 2 steps with a different micro-batch split per step, HF export + recoverable
checkpoint, probe logits, weights through ``iter_hf_params`` on every rank, 3 continued
steps, then a NaN-gradient step; plus bf16 runs (ZeRO-3 with gradient checkpointing), a
ZeRO-3 critic and forward-only reference engines, and a ZeRO-3 GRPO update with and without
prefix sharing. ``resume`` (a fresh process): load the checkpoint and replay the 3 continued
steps, then load another stage's HF export.
Results go to ``--out`` (rank 0 writes ``<mode>.pt``; every rank writes its own weights).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from fsdp_checks import PRECISION_LR, make_batch, precision_run, rank_slice
from ppo_checks import GROUP, make_rollout_batch
from prefix_checks import shared_vs_unshared

from tandemrl.algorithms.ppo import PPOActor, PPOCritic
from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.engine import DeepSpeedEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.deepspeed import DeepSpeedEngine
from tandemrl.engines.teardown import destroy_process_groups

STAGES = (1, 2, 3)
# Micro-batch split of the two first steps, per stage: the update must not depend on it.
SPLITS = {
    1: [MicroBatchSpec(n_mbs=1), MicroBatchSpec(max_tokens_per_mb=48)],
    2: [MicroBatchSpec(n_mbs=4), MicroBatchSpec(n_mbs=1)],
    3: [MicroBatchSpec(max_tokens_per_mb=48), MicroBatchSpec(n_mbs=3)],
}
FIRST_SEEDS = (100, 101)
CONTINUED_SEEDS = (300, 301, 302)
TOTAL_STEPS = 10  # linear LR decay over these, so a resumed schedule shows in the losses


def engine(
    stage: int, mixed_precision: str | None = None, gradient_checkpointing: bool = False, lr: float = 1e-4
) -> DeepSpeedEngine:
    """A ZeRO engine computing in fp32 unless ``mixed_precision`` says otherwise."""
    cfg = TrainEngineConfig(
        path=ARGS.model,
        mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        mb_spec=MicroBatchSpec(n_mbs=2),
        optimizer=OptimizerConfig(lr=lr, gradient_clipping=1.0, lr_scheduler_type="linear"),
        # 1 MB buckets: the tiny model's weights take several gathers under ZeRO-3.
        deepspeed=DeepSpeedEngineConfig(zero_stage=stage, param_gather_bucket_mb=1),
    )
    e = DeepSpeedEngine(cfg)
    e.create_process_group()
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=TOTAL_STEPS, train_batch_size=1))
    return e


def step(e: DeepSpeedEngine, seed: int) -> dict[str, float]:
    return SFTActor(e).train_lm(rank_slice(make_batch(seed)))


def nan_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits.float().mean() * float("nan")


def train_stage(stage: int) -> dict:
    rank = dist.get_rank()
    e = engine(stage)
    first = []
    for seed, spec in zip(FIRST_SEEDS, SPLITS[stage], strict=True):
        e.config.mb_spec = spec
        first.append(step(e, seed))
    e.config.mb_spec = MicroBatchSpec(n_mbs=2)
    out: dict = {"first": first, "params": e.full_state_dict()}
    e.set_version(2)
    d = os.path.join(ARGS.out, f"z{stage}")
    e.save(SaveLoadMeta(path=os.path.join(d, "hf"), weight_format="hf", tokenizer_path=ARGS.model))
    e.save(SaveLoadMeta(path=os.path.join(d, "ckpt"), weight_format="dcp", with_optim=True))
    out["probe"] = make_batch(999, n=4)
    out["logits"] = e.forward(out["probe"])
    # Every rank gets full tensors; they must stay valid after the generator moves on.
    mine = list(e.iter_hf_params())
    torch.save({"specs": e.hf_param_specs(), "params": mine}, os.path.join(d, f"iter_rank{rank}.pt"))
    out["continued"] = [step(e, seed)["loss"] for seed in CONTINUED_SEEDS]
    before = e.full_state_dict()
    out["nan"] = {"stats": e.train_batch(rank_slice(make_batch(1)), nan_loss, lambda mb: 1.0), "before": before}
    out["nan"]["after"] = e.full_state_dict()
    out["nan"]["next"] = step(e, 400)
    e.destroy()
    return out


def bf16_runs() -> dict:
    """5 steps in fp32 (ZeRO-1) and in bf16 over fp32 master weights: ZeRO-1, and ZeRO-3 with gradient
    checkpointing (fp32 updates do not depend on the stage, so one fp32 run is the reference of both)."""
    return {
        "fp32": precision_run(engine(1, lr=PRECISION_LR)),
        "bf16_z1": precision_run(engine(1, "bfloat16", lr=PRECISION_LR)),
        "bf16_z3": precision_run(engine(3, "bfloat16", gradient_checkpointing=True, lr=PRECISION_LR)),
    }


def other_models() -> dict:
    """A ZeRO-3 critic (3 value updates) alive next to forward-only reference engines (ZeRO-1 and -3)."""
    zero3 = DeepSpeedEngineConfig(zero_stage=3)
    cfg = TrainEngineConfig(
        path=ARGS.model, mixed_precision=None, optimizer=OptimizerConfig(lr=1e-5), is_critic=True, deepspeed=zero3
    )
    critic_engine = DeepSpeedEngine(cfg)
    critic = PPOCritic(PPOCriticConfig(engine=cfg, group_size=GROUP), critic_engine)
    critic_engine.create_process_group()
    critic_engine.initialize(None, None)
    batch = make_rollout_batch(ARGS.model)
    out: dict = {"batch": batch, "ref_logp": {}}
    for stage in (1, 3):
        zero = DeepSpeedEngineConfig(zero_stage=stage)
        ref_cfg = TrainEngineConfig(path=ARGS.model, mixed_precision=None, optimizer=None, deepspeed=zero)
        ref_engine = DeepSpeedEngine(ref_cfg)
        ref = PPOActor(PPOActorConfig(engine=ref_cfg, group_size=GROUP), ref_engine)
        ref_engine.create_process_group()
        ref_engine.initialize(None, None)
        out["ref_logp"][stage] = ref.compute_logp(batch)  # the whole batch on both ranks
        ref_engine.destroy()
    mine = rank_slice(batch)
    mine["values"] = critic.compute_values(mine)
    mine = PPOActor(
        PPOActorConfig(engine=TrainEngineConfig(path=ARGS.model), group_size=GROUP), critic_engine
    ).compute_advantages(mine)
    out["critic_losses"] = [critic.ppo_update(mine)[0]["loss"] for _ in range(3)]
    critic_engine.destroy()
    return out


def train() -> None:
    init_default_process_group()
    res: dict = {"batches": [make_batch(s) for s in FIRST_SEEDS]}
    for stage in STAGES:
        res[stage] = train_stage(stage)
    res["bf16"] = bf16_runs()
    res["others"] = other_models()
    res["prefix"] = shared_vs_unshared(DeepSpeedEngine, ARGS.model, deepspeed=DeepSpeedEngineConfig(zero_stage=3))
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(ARGS.out, "train.pt"))


def resume() -> None:
    init_default_process_group()
    res: dict = {}
    for stage in STAGES:
        d = os.path.join(ARGS.out, f"z{stage}")
        e = engine(stage)
        e.load(SaveLoadMeta(path=os.path.join(d, "ckpt"), weight_format="dcp", with_optim=True))
        out = {"version": e.get_version(), "lr": e.optimizer.param_groups[0]["lr"]}
        out["continued"] = [step(e, seed)["loss"] for seed in CONTINUED_SEEDS]
        # Load another stage's export; with lr 0 a step leaves the weights at the optimizer's
        # master copy, which must have followed the load.
        other = STAGES[stage % len(STAGES)]
        out["before_load"] = e.full_state_dict()
        e.load(SaveLoadMeta(path=os.path.join(ARGS.out, f"z{other}", "hf"), weight_format="hf"))
        for group in e.optimizer.param_groups:
            group["lr"] = 0.0
        e.train_batch(rank_slice(make_batch(5)), lambda logits, mb: logits.float().sum() * 0.0, lambda mb: 1.0)
        out["loaded_from"] = other
        out["after_load"] = e.full_state_dict()
        e.destroy()
        res[stage] = out
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(ARGS.out, "resume.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    ARGS = p.parse_args()
    torch.use_deterministic_algorithms(True)
    # Deterministic mode NaN-fills every torch.empty; DeepSpeed's reduce buckets hold 5e8 elements.
    torch.utils.deterministic.fill_uninitialized_memory = False
    {"train": train, "resume": resume}[ARGS.mode]()
    destroy_process_groups()
