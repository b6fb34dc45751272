"""GRPO on GSM8K: inference servers roll out while this SPMD script trains.

Started by the launcher, which brings up the servers named in allocation_mode:

    python -m tandemrl.launchers.local examples/gsm8k_grpo.py --config examples/gsm8k_grpo.yaml \
        train_dataset.path=../shared/data/gsm8k

Each step (see tandemrl/trainers/rl_loop.py): prepare_batch (async) or rollout_batch
(sync), proximal logp (recomputed only for off-policy batches; + reference logp if actor.kl_ctl > 0),
compute_advantages, ppo_update, then push the new weights to the servers, save, evaluate and log.
"""

from __future__ import annotations

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    trainer = RLTrainer(config, name="grpo")
    actor = PPOActor(config.actor, trainer.actor_engine)  # the algorithm on the backend's engine
    ref = trainer.reference()
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(workflow, ppo_train_step(actor, ref=ref), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
