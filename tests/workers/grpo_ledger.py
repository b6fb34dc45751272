"""GRPO on GSM8K prompts (examples/gsm8k_grpo.py) whose rollouts leave the sample ledger every way a
run can: the reward fails on prompts whose id is 0 mod 5 (the workflow drops the group), is the same
for every sample of prompts whose id is 1 mod 5 (dynamic sampling filters the group), and otherwise
differs between the samples (the share of digits plus a tiny random term). Run it with
``actor.dynamic_sampling=true`` and ``actor.mask_no_eos=true``, so truncated samples are ``too_long``.
Run through the launcher like the example.
"""

from __future__ import annotations

import random
from typing import Any

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main

FAILS, UNIFORM = 0, 1  # prompt id mod 5


def reward(completions: str, id: int, **_: Any) -> float:  # noqa: A002 (the dataset's column)
    if id % 5 == FAILS:
        raise RuntimeError(f"no reward for prompt {id}")
    if id % 5 == UNIFORM:
        return 0.5
    return sum(c.isdigit() for c in completions) / max(len(completions), 1) + 1e-3 * random.random()


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    trainer = RLTrainer(config, name="grpo")
    workflow, eval_workflow = trainer.rlvr_workflows(reward)
    trainer.run(workflow, ppo_train_step(PPOActor(config.actor, trainer.actor)), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
