"""ReMax on GSM8K: REINFORCE whose baseline is the reward of a greedy completion of the same prompt.

    python -m tandemrl.launchers.local examples/gsm8k_remax.py --config examples/gsm8k_remax.yaml \
        train_dataset.path=../shared/data/gsm8k

A workflow plus an algorithm (docs/customize_algorithm.md): ``ReMaxRLVRWorkflow`` generates
n sampled and one greedy completion per prompt and rewards each sample with
``r(sample) - r(greedy)``; ``ReinforceActor(config.actor, trainer.actor_engine).train_reinforce`` (on the
engine of the backend in allocation_mode) takes one step of ``-w * A * log p`` per batch, with log p
at the sampling temperature (``actor.temperature``) under the sampler's truncation (the replay) and
``w`` the off-policy correction's weight (``actor.offpolicy_correction``, default token TIS).
The loop is the shared one (tandemrl/trainers/rl_loop.py).
"""

from __future__ import annotations

from tandemrl.algorithms.reinforce import ReinforceActor, config_problem
from tandemrl.configs import GRPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, reinforce_train_step
from tandemrl.utils.cli import run_main
from tandemrl.workflows.remax import ReMaxRLVRWorkflow


def main(argv: list[str]) -> None:
    # config_problem: offpolicy_correction none with async training is refused at load (the launchers' pre-flight).
    config, _ = load_config_or_exit(argv, GRPOConfig, checks=[config_problem])
    trainer = RLTrainer(config, name="remax")
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn, workflow_cls=ReMaxRLVRWorkflow)
    trainer.run(workflow, reinforce_train_step(ReinforceActor(config.actor, trainer.actor_engine)), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
