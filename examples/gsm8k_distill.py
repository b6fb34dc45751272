"""On-policy distillation on GSM8K: the student samples through its vLLM servers, a teacher model
on its own vLLM servers scores every sampled token, and the student descends the reverse KL.

The launcher starts the teacher's servers (``vllm[teacher]`` in ``allocation_mode``, model from
``aux_servers.teacher.path``) beside the student's:

    python -m tandemrl.launchers.local examples/gsm8k_distill.py --config examples/gsm8k_distill.yaml \
        train_dataset.path=../shared/data/gsm8k

A teacher already running elsewhere is used instead when ``teacher.server_addrs=[host:port]`` is set.

Each step: rollout (each group scored by the teacher as it finishes, overlapping training when async),
proximal logp when needed, DistillActor.compute_advantages (teacher - student per token, plus
``actor.reward_coef`` x the GSM8K reward's advantage), the PPO update, weight push. See docs/distillation.md.
"""

from __future__ import annotations

from tandemrl.algorithms.distill import DistillActor
from tandemrl.api.aux_servers import aux_server_addresses
from tandemrl.configs.distill import DistillConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main
from tandemrl.workflows.distill import TeacherScoredWorkflow, connect_teacher


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, DistillConfig)
    trainer = RLTrainer(config, name="distill")
    actor = DistillActor(config.actor, trainer.actor_engine)  # the algorithm on the backend's engine
    # teacher.server_addrs if set, else the launcher's vllm[teacher] servers.
    teacher = connect_teacher(config.teacher, trainer.alloc.gen_backend, lookup=aux_server_addresses)
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(TeacherScoredWorkflow(workflow, teacher), ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()  # stops rollout first: episodes still in flight may be asking the teacher
    teacher.destroy()


if __name__ == "__main__":
    run_main(main)
