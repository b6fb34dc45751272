"""GRPO on reasoning-gym tasks, each scored by its own verifier (docs/environments.md).

The tasks, weights and task configs are the config's ``train_dataset.reasoning_gym`` section; their rows are
generated into ``train_dataset.path`` before any process starts (``tandemrl.data.reasoning_gym``), the held-out
split beside them. The main-job variant (``bash scripts/main.sh --reasoning-gym``):

    python -m tandemrl.launchers.local examples/reasoning_gym_grpo.py \
        --config examples/reasoning_gym_grpo_smollm2.yaml

The loop is the GSM8K one (tandemrl/trainers/rl_loop.py); only the reward differs.
"""

from __future__ import annotations

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.rewards.reasoning_gym import reasoning_gym_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    if not config.train_dataset.reasoning_gym.enabled:
        raise ValueError("train_dataset.reasoning_gym.tasks: empty; name the reasoning-gym tasks to train on")
    trainer = RLTrainer(config, name="grpo")
    actor = PPOActor(config.actor, trainer.actor_engine)
    workflow, eval_workflow = trainer.rlvr_workflows(reasoning_gym_reward_fn)
    trainer.run(workflow, ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
