"""GRPO on GSM8K (examples/gsm8k_grpo.py) that also records what every trainer rank trained on.

Run through the launcher like the example. Before each update, every rank appends one JSON
line to ``{cluster.fileroot}/dp_probe/{trial_name}/rank{RANK}.jsonl``: the step, its DP rank,
the engine's weight version, and the prompt of every row of its batch (the tokens before the
first loss token), so a test can check that each DP rank trained on its own whole groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, TrainStep, ppo_train_step
from tandemrl.utils.cli import run_main


def _prompts(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    out = []
    for ids, mask, loss in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], strict=True):
        first_generated = int(loss.nonzero()[0, 0]) if loss.any() else int(mask.sum())
        out.append(ids[:first_generated].tolist())
    return out


def recording(step: TrainStep, actor: Any, path: Path) -> TrainStep:
    def wrapped(batch: dict[str, torch.Tensor], global_step: int) -> None:
        record = {
            "step": global_step,
            "rank": dist.get_rank(),
            "dp_rank": actor.data_parallel_rank,
            "dp_world": actor.data_parallel_world_size,
            "version": actor.get_version(),
            "prompts": _prompts(batch),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step(batch, global_step)

    return wrapped


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    trainer = RLTrainer(config, name="grpo")
    out = Path(config.cluster.fileroot) / "dp_probe" / config.trial_name
    out.mkdir(parents=True, exist_ok=True)
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    step = recording(
        ppo_train_step(PPOActor(config.actor, trainer.actor_engine)),
        trainer.actor_engine,
        out / f"rank{os.environ['RANK']}.jsonl",
    )
    trainer.run(workflow, step, eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
