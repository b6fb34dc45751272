"""torchrun worker (2 ranks): DistillActor (on-policy distillation) takes 2 steps on FSDP2 (d2),
DeepSpeed ZeRO-3 (d2) and Megatron (t2), each engine from its backend's registry row.

The batch is ppo_checks' rollout batch (student behaviour logprobs = HF logprobs + noise) plus
``teacher_logprobs`` from a larger tiny teacher run with transformers. Rank 0 writes
``distill.pt``: per backend, the engine class, the step losses and the mean squared teacher-student
logprob gap on the batch's generated tokens before and after each step (the policy gradient with
advantage ``teacher - student`` descends half that squared gap on a fixed batch).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from new_algorithm_checks import build_engine, dp_share, on_every_backend
from ppo_checks import GROUP, hf_logprobs, make_rollout_batch

from tandemrl.algorithms.distill import DistillActor
from tandemrl.algorithms.layout import shift_left
from tandemrl.algorithms.ppo import action_mask_of
from tandemrl.configs.distill import DistillActorConfig
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import NormConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.teardown import destroy_process_groups

STEPS = 2


def squared_gap(actor: DistillActor, batch: dict) -> float:
    """Mean over the whole batch's generated tokens of (teacher - student logp)^2 (summed over DP ranks)."""
    action = action_mask_of(batch)
    student = actor.compute_logp(batch)
    teacher = shift_left(batch["teacher_logprobs"])
    sums = torch.tensor([float(((teacher - student)[action] ** 2).sum()), float(action.sum())], dtype=torch.float64)
    if actor.engine.data_parallel_world_size > 1:
        dist.all_reduce(sums, group=actor.engine.data_parallel_group)
    return float(sums[0] / sums[1])


def run_backend(model: str, allocation: str, extra: dict, batch: dict) -> dict:
    engine = build_engine(model, allocation, extra, STEPS)
    config = DistillActorConfig(
        engine=TrainEngineConfig(path=model),
        group_size=GROUP,
        adv_norm=NormConfig(mean_level="none", std_level="none"),
        recompute_logprob="always",  # the student's logp from the current weights each step
    )
    actor = DistillActor(config, engine)
    share = dp_share(engine, batch)
    gaps, losses = [squared_gap(actor, share)], []
    for _ in range(STEPS):
        step_batch = dict(share)
        step_batch["prox_logp"] = actor.proximal_logp(step_batch)
        step_batch = actor.compute_advantages(step_batch)
        losses.append(actor.ppo_update(step_batch)[0]["loss"])
        gaps.append(squared_gap(actor, share))
    engine.destroy()
    return {"engine": type(engine).__name__, "losses": losses, "gaps": gaps}


def teacher_scored_batch(model: str, teacher: str) -> dict:
    """ppo_checks' rollout batch of ``model`` plus ``teacher``'s HF logprobs on its generated tokens."""
    batch = make_rollout_batch(model)
    lens = batch["attention_mask"].sum(dim=1).tolist()
    batch["teacher_logprobs"] = torch.where(
        batch["loss_mask"].bool(), hf_logprobs(teacher, batch["input_ids"], lens), 0.0
    )
    return batch


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for flag in ("--model", "--teacher", "--out"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    init_default_process_group()
    scored = teacher_scored_batch(args.model, args.teacher)
    on_every_backend(lambda a, x: run_backend(args.model, a, x, scored), os.path.join(args.out, "distill.pt"))
    destroy_process_groups()
