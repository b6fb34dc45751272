"""GRPO on GSM8K whose generation lengths are heavy-tailed: ``examples/gsm8k_grpo.py`` with
:class:`agentic_env.LongTailWorkflow` (each request's ``max_new_tokens`` drawn from a Pareto distribution whose
minimum and tail index come from ``$TANDEMRL_BENCH_TAIL``, ``"16,1.2"`` by default). Run by
``bench/async_agentic.py`` through the local launcher.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentic_env import LongTailWorkflow  # noqa: E402

from tandemrl.algorithms.ppo import PPOActor  # noqa: E402
from tandemrl.configs import GRPOConfig  # noqa: E402
from tandemrl.rewards.gsm8k import gsm8k_reward_fn  # noqa: E402
from tandemrl.trainers.entry import load_config_or_exit  # noqa: E402
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step  # noqa: E402
from tandemrl.utils.cli import run_main  # noqa: E402


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    min_tokens, alpha = os.environ.get("TANDEMRL_BENCH_TAIL", "16,1.2").split(",")
    trainer = RLTrainer(config, name="grpo-longtail")
    actor = PPOActor(config.actor, trainer.actor_engine)
    workflow, eval_workflow = trainer.rlvr_workflows(
        gsm8k_reward_fn, LongTailWorkflow, min_tokens=int(min_tokens), alpha=float(alpha)
    )
    trainer.run(workflow, ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
