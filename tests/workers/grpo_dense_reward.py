"""GRPO on GSM8K prompts (examples/gsm8k_grpo.py) with a dense reward: the share of digits in the
completion. A tiny random model never earns the GSM8K reward, so every advantage would be 0 and
training would not move the weights; this reward differs between the samples of a group.
Run through the launcher like the example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def digit_share(completions: str, **_: Any) -> float:
    return sum(c.isdigit() for c in completions) / max(len(completions), 1)


def run_grpo(argv: list[str], reward: Callable[..., float]) -> None:
    """The GRPO example's run with ``reward`` (also used by tests/workers/grpo_ledger.py)."""
    config, _ = load_config_or_exit(argv, GRPOConfig)
    trainer = RLTrainer(config, name="grpo")
    workflow, eval_workflow = trainer.rlvr_workflows(reward)
    trainer.run(workflow, ppo_train_step(PPOActor(config.actor, trainer.actor_engine)), eval_workflow)
    trainer.close()


def main(argv: list[str]) -> None:
    run_grpo(argv, digit_share)


if __name__ == "__main__":
    run_main(main)
