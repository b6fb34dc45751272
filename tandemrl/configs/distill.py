"""Configs of on-policy distillation: the student's actor (a PPO-family actor plus two weights) and the run.

The teacher is a model served by its own inference servers (``teacher.server_addrs``); see
``docs/distillation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandemrl.configs.experiment import GRPOConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.configs.rollout import InferenceClientConfig


@dataclass
class DistillActorConfig(PPOActorConfig):
    """A PPO-family actor whose per-token advantage is ``distill_coef * (teacher logp - student logp)``
    plus ``reward_coef`` times the task-reward advantage of the PPO fields (adv_norm etc.)."""

    distill_coef: float = field(
        default=1.0,
        metadata={"help": "Weight of the per-token reverse-KL advantage (teacher - student logp).", "min": 0.0},
    )
    reward_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of the task-reward advantage mixed in (0: pure distillation).", "min": 0.0},
    )


@dataclass
class DistillConfig(GRPOConfig):
    """GRPOConfig with a distillation actor and the teacher's inference client."""

    actor: DistillActorConfig = field(default_factory=DistillActorConfig)
    teacher: InferenceClientConfig = field(
        default_factory=InferenceClientConfig,
        metadata={
            "help": "Client of the teacher's servers; teacher.server_addrs lists them (host:port). It never "
            "falls back to the policy servers' environment."
        },
    )
