"""On-policy distillation: the student samples, a teacher scores the sampled tokens, and the
per-token advantage is ``teacher logp - student logp``: the policy gradient descends, token by
token, the reverse KL(student || teacher) at the states the student visits (each token's own
log-ratio only, not the sum over the tokens after it: a per-token, lower-variance surrogate of
the sequence KL's gradient, as on-policy distillation does).

``reverse_kl_advantages`` is the pure tensor math. ``DistillActor`` is a :class:`PPOActor` whose
``compute_advantages`` puts that advantage on every generated token (optionally plus the task
reward's advantage), so the PPO update, its off-policy corrections and every backend come for free.
The teacher's logprobs arrive in the batch as ``teacher_logprobs`` (token-aligned like ``logprobs``;
``tandemrl.workflows.distill`` fills them).
"""

from __future__ import annotations

from typing import cast

import torch

from tandemrl.algorithms.ppo import PPOActor, PPOBatch, require_fields
from tandemrl.algorithms.recompute import server_logp
from tandemrl.api.engine import TrainEngine
from tandemrl.configs.distill import DistillActorConfig
from tandemrl.utils import stats_tracker


class DistillBatch(PPOBatch, total=False):
    """A PPO batch plus the teacher's logprobs."""

    teacher_logprobs: torch.Tensor  # [B, L] token-aligned, from the workflow (0 off generated tokens)
    teacher_logp: torch.Tensor  # next-token aligned (written by DistillActor.compute_advantages)


def reverse_kl_advantages(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """Per-token advantage ``coef * (teacher_logp - student_logp)`` on masked tokens, 0 elsewhere.

    With the student's tokens sampled from the student, ``E[-A_t * grad log p_student(y_t)]`` is
    ``coef`` times the gradient of the token-level KL(student || teacher) at step t with the
    state held fixed (the mode-seeking, reverse direction). It is not the full gradient of the
    sequence KL: that would weigh each token by the sum of the log-ratios from t on.
    """
    if teacher_logp.shape != student_logp.shape or teacher_logp.shape != mask.shape:
        raise ValueError(
            f"reverse_kl_advantages: shapes differ: teacher {tuple(teacher_logp.shape)}, "
            f"student {tuple(student_logp.shape)}, mask {tuple(mask.shape)}"
        )
    return torch.where(mask.bool(), coef * (teacher_logp.float() - student_logp.float()), 0.0)


class DistillActor(PPOActor):
    """PPOActor with the reverse-KL advantage; see the module docstring and DistillActorConfig."""

    def __init__(self, config: DistillActorConfig, engine: TrainEngine):
        if config.temperature != 1.0:
            raise ValueError(
                f"DistillActorConfig.temperature must be 1.0 (teacher logprobs are at temperature 1), "
                f"got {config.temperature}"
            )
        super().__init__(config, engine)
        self.distill_config = config

    def compute_advantages(self, batch: PPOBatch) -> PPOBatch:
        """PPOActor's advantages (rewards, KL reward, adv_norm) scaled by ``reward_coef``, plus
        ``distill_coef * (teacher - student)`` per generated token. The student's logp is
        ``prox_logp`` when recomputed, else the behaviour logprobs of the rollout."""
        hint = " (wrap the workflow in tandemrl.workflows.distill.TeacherScoredWorkflow)"
        require_fields(batch, ("teacher_logprobs",), "DistillActor.compute_advantages", hint)
        cfg = self.distill_config
        out = cast(DistillBatch, super().compute_advantages(batch))
        action = out["action_mask"]
        teacher = server_logp(out["teacher_logprobs"].to(action.device), action)
        prox = out.get("prox_logp")
        student = out["behav_logp"] if prox is None else torch.where(action, prox.float(), 0.0)
        distill = reverse_kl_advantages(teacher, student, action, cfg.distill_coef)
        out["teacher_logp"] = teacher
        out["advantages"] = distill + cfg.reward_coef * out["advantages"]
        with stats_tracker.scope("distill"):
            stats_tracker.denominator(n_action_tokens=action)
            stats_tracker.stat(
                denominator="n_action_tokens",
                reverse_kl=torch.where(action, student - teacher, 0.0),  # k1 estimate, per token
                teacher_logp=teacher,
                student_logp=student,
            )
        return out
