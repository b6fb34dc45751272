"""PPO with a learned critic on GSM8K: GAE advantages from a value model trained alongside the policy.

    python -m tandemrl.launchers.local examples/gsm8k_ppo.py --config examples/gsm8k_ppo.yaml \
        train_dataset.path=../shared/data/gsm8k

The same loop as GRPO (tandemrl/trainers/rl_loop.py) with one more engine: the critic
(``PPOCritic`` on an engine built from ``critic.engine``, whose ``is_critic`` defaults to true;
weights from ``critic.engine.path``, default the actor's, with a fresh value head). Per step: actor logp, critic values, compute_advantages (GAE), actor
ppo_update, critic ppo_update on the returns.
"""

from __future__ import annotations

from tandemrl.algorithms.ppo import PPOActor, PPOCritic
from tandemrl.configs import PPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, PPOConfig)
    if not config.critic.engine.is_critic:
        raise ValueError("critic.engine.is_critic: must be true for PPO with a critic (it builds the value head)")
    trainer = RLTrainer(config, name="ppo")
    actor = PPOActor(config.actor, trainer.actor_engine)
    ref = trainer.reference()
    critic = PPOCritic(config.critic, trainer.add_engine(config.critic.engine, "critic.engine"))
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(workflow, ppo_train_step(actor, ref=ref, critic=critic), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
