"""Policy-gradient losses: PPO clipped surrogate (asymmetric/dual clip, decoupled, GSPO), REINFORCE."""

from __future__ import annotations

import torch

from tandemrl.algorithms.aggregation import aggregate_loss
from tandemrl.algorithms.layout import broadcast_to_tokens, per_sequence_sum

RATIO_LEVELS = ("token", "sequence")


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Mean masked log-ratio of each sequence, broadcast to its tokens (differentiable)."""
    m = mask.bool()
    total = per_sequence_sum(torch.where(m, log_ratio, 0.0), cu_seqlens)
    count = per_sequence_sum(m.to(log_ratio.dtype), cu_seqlens).clamp(min=1)
    return broadcast_to_tokens(total / count, log_ratio, cu_seqlens)


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_logp: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    ratio_level: str = "token",
    agg_mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    agg_norm_len: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate; returns ``(loss, per-token stats)``.

    Per token (A = advantage, eps_hi = ``eps_clip_higher`` or ``eps_clip``):

    * ratio ``r = exp(logp - old_logp)``; with ``ratio_level="sequence"`` (GSPO) every token of
      sequence i uses ``r_i = exp(mean_t(logp - old_logp))``, the geometric mean of its token ratios.
    * ``L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_hi))``.
    * dual clip (``c_clip > 1``): for ``A < 0``, ``L = min(L, -c_clip * A)`` bounds the loss of
      very large ratios.
    * decoupled PPO (``behav_logp`` given): ``old_logp`` is the proximal policy (recomputed before
      the update) and ``L *= w`` with the behaviour importance weight ``w = exp(old_logp - behav_logp)``
      (no gradient); tokens with ``w > behav_imp_weight_cap`` get ``w = 0`` but stay in denominators.

    The loss is :func:`~tandemrl.algorithms.aggregation.aggregate_loss` of L over ``mask``.
    Stats (detached, same shape as ``logp``): ``ratio``, ``clip_mask`` (clipped term active),
    ``dual_clip_mask``, ``approx_kl`` (``old_logp - logp``), ``behav_imp_weight``, ``behav_kept``
    and ``mask``; their masked means are the usual fractions and averages.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {RATIO_LEVELS}, got '{ratio_level}'")
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    m = mask.bool()
    adv = torch.where(m, advantages.float(), 0.0)
    log_ratio = torch.where(m, logp.float() - old_logp.float(), 0.0)
    if ratio_level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, m, cu_seqlens)
    ratio = torch.exp(log_ratio)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    pg = torch.maximum(loss1, loss2)
    clip_mask = (loss2 > loss1) & m
    dual_mask = torch.zeros_like(m)
    if c_clip is not None:
        bound = -adv * c_clip
        dual_mask = (adv < 0) & (pg > bound) & m
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    weight = torch.ones_like(pg)
    kept = m.clone()
    if behav_logp is not None:
        weight = torch.where(m, torch.exp(old_logp.float() - behav_logp.float()), 0.0).detach()
        if behav_imp_weight_cap is not None:
            kept = m & (weight <= behav_imp_weight_cap)
            weight = torch.where(kept, weight, 0.0)
        pg = pg * weight
    loss = aggregate_loss(pg, m, agg_mode, cu_seqlens, agg_norm_len)
    stats = {
        "ratio": ratio.detach(),
        "clip_mask": clip_mask,
        "dual_clip_mask": dual_mask,
        "approx_kl": (-log_ratio).detach(),
        "behav_imp_weight": weight,
        "behav_kept": kept,
        "mask": m,
    }
    return loss, stats


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg_mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    agg_norm_len: float = 1.0,
) -> torch.Tensor:
    """Loss term ``-coef * aggregate(entropy)``: adding it rewards exploration."""
    return -coef * aggregate_loss(entropy.float(), mask, agg_mode, cu_seqlens, agg_norm_len)


def reinforce_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE ``-sum(A * logp) / n_tokens`` over masked tokens (token mean)."""
    return aggregate_loss(-advantages.float() * logp.float(), mask, "token-mean")
