"""GRPO on an OpenEnv environment, unmodified (docs/environments.md, "OpenEnv").

The environment server runs in its own process with the python of ``openenv.python`` (build it once with
``python -m tandemrl.workflows.openenv setup``): the local launcher starts it from ``openenv.app`` and stops it;
``openenv.url`` names a running one instead. Each episode is a session on that server, the model's calls go
through the agent proxy (the trainer gets the server's exact tokens), and the environment's step rewards are the
rewards. The rows are reset seeds, written to ``train_dataset.path`` by the launcher's input check:

    python -m tandemrl.launchers.local examples/openenv_grpo.py --config examples/openenv_grpo.yaml
"""

from __future__ import annotations

import contextlib
import os

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.api.aux_servers import OPENENV_URL_ENV
from tandemrl.configs.openenv import OpenEnvGRPOConfig
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import EVAL_STATS, RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main
from tandemrl.workflows.agent import AgentWorkflow
from tandemrl.workflows.openenv import EnvServer, OpenEnv, ensure_seed_rows


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, OpenEnvGRPOConfig)
    ensure_seed_rows(config.openenv, config.train_dataset.path)  # written already when started by a launcher
    trainer = RLTrainer(config, name="grpo-openenv")
    with contextlib.ExitStack() as stack:
        url = os.environ.get(OPENENV_URL_ENV) or config.openenv.url
        if not url:  # no launcher started it (Ray, Slurm, a bare torchrun): this rank starts its own
            rank = os.environ.get("RANK", "0")
            server = EnvServer(config.openenv, log_file=f"{trainer.logger.log_dir}/openenv-rank{rank}.log")
            stack.callback(server.stop)
            server.wait_healthy(config.openenv.start_timeout)
            url = server.url
        env = OpenEnv(config.openenv, url)
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
