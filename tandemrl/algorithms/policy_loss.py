"""Policy-gradient losses: PPO clipped surrogate (asymmetric/dual clip, GSPO, mismatch corrections), CISPO, REINFORCE."""

from __future__ import annotations

import torch

from tandemrl.algorithms.aggregation import aggregate_loss
from tandemrl.algorithms.layout import broadcast_to_tokens, per_sequence_sum
from tandemrl.algorithms.offpolicy import Correction, cispo_objective, correction_weights, resolve_correction

RATIO_LEVELS = ("token", "sequence")
# |log r| is clamped to this before exp: r stays in [2.1e-9, 4.9e8], finite in fp32 (exp overflows
# past ~88.7), so one runaway token cannot turn the loss and every gradient of the step into NaN.
LOG_RATIO_BOUND = 20.0


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Mean masked log-ratio of each sequence, broadcast to its tokens (differentiable)."""
    m = mask.bool()
    total = per_sequence_sum(torch.where(m, log_ratio, 0.0), cu_seqlens)
    count = per_sequence_sum(m.to(log_ratio.dtype), cu_seqlens).clamp(min=1)
    return broadcast_to_tokens(total / count, log_ratio, cu_seqlens)


def guarded_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, ratio_level: str, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log r, live, clamped)``: the PPO log-ratio clamped to ``+-LOG_RATIO_BOUND`` (0 off ``live``),
    the masked tokens whose ``logp - old_logp`` is finite (a -inf logp, e.g. outside a replayed
    truncation, is not), and the live tokens whose log-ratio was clamped. ``sequence``: each
    sequence's mean over its live tokens, on every token. A clamped token has no gradient through r
    (PPO clips it anyway unless A < 0 without a dual clip); a dropped one has weight 0."""
    raw = logp.float() - old_logp.float()
    live = mask & torch.isfinite(raw.detach())
    log_ratio = torch.where(live, raw, 0.0)
    if ratio_level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, live, cu_seqlens)
    clamped = live & (log_ratio.detach().abs() > LOG_RATIO_BOUND)
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), live, clamped


def _ppo_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, eps_clip: float, hi: float, c_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (with the dual clip), its clip mask and dual-clip mask."""
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    pg = torch.maximum(loss1, loss2)
    clip_mask = (loss2 > loss1) & m
    dual_mask = torch.zeros_like(m)
    if c_clip is not None:
        bound = -adv * c_clip
        dual_mask = (adv < 0) & (pg > bound) & m
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    return pg, clip_mask, dual_mask


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
    correction: Correction | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (or CISPO) with a train/rollout mismatch correction; returns ``(loss, per-token stats)``.

    Per token (A = advantage, eps_hi = ``eps_clip_higher`` or ``eps_clip``):

    * ratio ``r = exp(logp - old_logp)``; with ``ratio_level="sequence"`` (GSPO) every token of
      sequence i uses ``r_i = exp(mean_t(logp - old_logp))``, the geometric mean of its token ratios.
    * ``L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_hi))``.
    * dual clip (``c_clip > 1``): for ``A < 0``, ``L = min(L, -c_clip * A)`` bounds the loss of
      very large ratios.
    * ``correction.kind == "cispo"``: ``L = -sg(clip(r, 1 - eps_clip, 1 + eps_hi)) * A * logp``
      instead (no dual clip).
    * mismatch correction (``behav_logp`` given): ``old_logp`` is the trainer's proximal policy
      and ``L *= w``, the detached weight of :func:`~tandemrl.algorithms.offpolicy.correction_weights`
      on ``rho = exp(old_logp - behav_logp)``. Without ``correction`` this is decoupled PPO:
      ``w = rho``, and tokens with ``rho > behav_imp_weight_cap`` get ``w = 0`` (``mis``).
      Dropped tokens stay in the denominators.
    * overflow guard (:func:`guarded_log_ratio`): ``log r`` clamped to +-20, non-finite tokens dropped.

    The loss is :func:`~tandemrl.algorithms.aggregation.aggregate_loss` of L over ``mask``.
    Stats (detached, same shape as ``logp``): ``ratio``, ``clip_mask`` (clipped term active),
    ``dual_clip_mask``, ``approx_kl`` (``old_logp - logp``), ``behav_imp_weight``, ``behav_kept``,
    ``behav_truncated``, ``ratio_clamped``, ``nonfinite`` (dropped) and ``mask``; their masked means
    are the usual fractions and averages.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {RATIO_LEVELS}, got '{ratio_level}'")
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    if correction is None:
        correction = resolve_correction("auto", use_decoupled_loss=True, behav_imp_weight_cap=behav_imp_weight_cap)
    elif behav_imp_weight_cap is not None:
        raise ValueError("ppo_policy_loss: pass behav_imp_weight_cap or correction, not both")
    cispo = correction.kind == "cispo"
    if cispo and c_clip is not None:
        raise ValueError("c_clip (dual clip) has no effect with offpolicy_correction 'cispo'; unset it")
    m = mask.bool()
    log_ratio, live, clamped = guarded_log_ratio(logp, old_logp, m, ratio_level, cu_seqlens)
    adv, ratio = torch.where(live, advantages.float(), 0.0), torch.exp(log_ratio)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    if cispo:
        pg, clip_mask = cispo_objective(torch.where(live, logp.float(), 0.0), ratio, adv, eps_clip, hi)
        clip_mask, dual_mask = clip_mask & live, torch.zeros_like(m)
    else:
        pg, clip_mask, dual_mask = _ppo_surrogate(ratio, adv, live, eps_clip, hi, c_clip)
    weight, kept, truncated = live.float(), live.clone(), torch.zeros_like(m)
    if behav_logp is not None:
        cw = correction_weights(old_logp, behav_logp, live, correction, cu_seqlens)
        weight, kept, truncated = cw["weight"], cw["kept"], cw["truncated"]
    pg = torch.where(live, pg * weight, 0.0)
    loss = aggregate_loss(pg, m, agg_mode, cu_seqlens, agg_norm_len)
    stats = {
        "ratio": ratio.detach(),
        "clip_mask": clip_mask,
        "dual_clip_mask": dual_mask,
        "approx_kl": (-log_ratio).detach(),
        "behav_imp_weight": weight,
        "behav_kept": kept,
        "behav_truncated": truncated,
        "ratio_clamped": clamped,
        "nonfinite": m & ~live,
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
