"""GRPO on a verifiers environment, unmodified (docs/environments.md, "verifiers").

The environment runs in its own process with the python of ``verifiers.python`` (build it once with
``python -m tandemrl.workflows.verifiers setup``); its model calls go through the agent proxy, so the trainer
gets the server's exact tokens, and its rubric is the reward. Its tasks are the dataset rows, written to
``train_dataset.path`` by the launcher's input check:

    python -m tandemrl.launchers.local examples/verifiers_grpo.py --config examples/verifiers_grpo.yaml
"""

from __future__ import annotations

import os

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs.verifiers import VerifiersGRPOConfig
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import EVAL_STATS, RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main
from tandemrl.workflows.agent import AgentWorkflow
from tandemrl.workflows.verifiers import VerifiersEnv, ensure_task_rows


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, VerifiersGRPOConfig)
    ensure_task_rows(config.verifiers, config.train_dataset.path)  # written already when started by a launcher
    trainer = RLTrainer(config, name="grpo-verifiers")
    rank = os.environ.get("RANK", "0")
    with VerifiersEnv(config.verifiers, log_file=f"{trainer.logger.log_dir}/verifiers-rank{rank}.log") as env:
        actor = PPOActor(config.actor, trainer.actor_engine)
        workflow = AgentWorkflow(env.agent(), trainer.gconfig, trainer.tokenizer, config.agent)
        eval_gconfig = trainer.gconfig.new(greedy=True, n_samples=1)
        eval_workflow = AgentWorkflow(
            env.agent(EVAL_STATS), eval_gconfig, trainer.tokenizer, config.agent, stat_scope=EVAL_STATS
        )
        trainer.run(workflow, ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)
