"""KL(pi || pi_ref) estimators on sampled tokens, used as a reward penalty or a loss term."""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi, with ``d = logp - ref_logp``.

    * k1 = d                       (unbiased, high variance, can be negative)
    * k2 = d^2 / 2                 (biased, low variance)
    * k3 = exp(-d) - 1 + d         (unbiased, >= 0; GRPO's loss term)
    """
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"kl_estimator must be one of {ESTIMATORS}, got '{estimator}'")


def kl_penalty_rewards(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, coef: float, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token reward ``-coef * kl`` on masked positions (0 elsewhere)."""
    return torch.where(mask.bool(), -coef * kl_estimate(logp, ref_logp, estimator), 0.0)
