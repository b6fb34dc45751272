"""PPO with a learned critic on GSM8K: GAE advantages from a value model trained alongside the policy.

    python -m tandemrl.launchers.local examples/gsm8k_ppo.py --config examples/gsm8k_ppo.yaml \
        train_dataset.path=../shared/data/gsm8k

The same loop as GRPO (tandemrl/trainers/rl_loop.py) with one more engine: the critic
(``critic.is_critic: true``; weights from ``critic.path``, default the actor's, with a fresh
value head). Per step: actor logp, critic values, compute_advantages (GAE), actor
ppo_update, critic ppo_update on the returns.
"""

from __future__ import annotations

from tandemrl.configs import PPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, PPOConfig)
    if not config.critic.is_critic:
        raise ValueError("critic.is_critic: must be true for PPO with a critic (it builds the value head)")
    trainer = RLTrainer(config, "ppo_actor", name="ppo")
    ref = trainer.reference()
    critic = trainer.add_engine("ppo_critic", config.critic, "critic")
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(workflow, ppo_train_step(trainer.actor, config.actor, ref=ref, critic=critic), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
