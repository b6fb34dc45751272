"""Train/rollout mismatch: importance corrections and metrics, as pure tensor functions.

The behaviour policy mu is the server that sampled the tokens (its logprobs ``behav_logp``);
the trainer's proximal policy is the trainer's logprobs at the pre-update weights
(``prox_logp``). Their per-token ratio ``rho_t = exp(prox_t - behav_t)`` carries both the
staleness (older weights generated the token) and the numerical gap between two
implementations. A correction turns rho into a detached per-token weight ``w`` that multiplies
the PPO (or CISPO) term of each token; ``w = 0`` drops a token but leaves it in the loss
denominators. With ``C = cap`` and ``c = 1 / cap_low``:

==========  =============  ====================================================================
kind        ratio          weight
==========  =============  ====================================================================
none        -              1
tis         token rho_t    min(rho_t, C)                          (truncated IS)
mis         token rho_t    rho_t if rho_t <= C else 0             (masked IS; decoupled PPO cap)
seq_tis     sequence R_i   min(R_i, C) on every token of sequence i
seq_mis     sequence R_i   R_i if R_i <= C else 0
geo_mask    geometric G_i  G_i if c <= G_i <= C else 0            (whole sequence kept or dropped)
icepop      token rho_t    rho_t if c <= rho_t <= C else 0        (two-sided token mask)
cispo       token rho_t    min(rho_t, C), with the CISPO objective instead of PPO's surrogate
==========  =============  ====================================================================

``R_i = prod_t rho_t`` (``seq_ratio="product"``) or ``G_i = exp(mean_t log rho_t)``
(``"geometric"``), over the sequence's masked tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandemrl.algorithms.kl import kl_estimate
from tandemrl.algorithms.layout import broadcast_to_tokens, per_sequence_sum

CORRECTIONS = ("auto", "none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask", "icepop", "cispo")
SEQ_RATIOS = ("product", "geometric")
_SEQUENCE_KINDS = ("seq_tis", "seq_mis", "geo_mask")
_TRUNCATING = ("tis", "seq_tis", "cispo")
_TWO_SIDED = ("icepop", "geo_mask")
# What ``auto`` resolves to without the legacy decoupled fields: token TIS at C = 2.
AUTO_KIND = "tis"


@dataclass(frozen=True)
class Correction:
    """A resolved correction (``kind`` is never ``auto``); see the module table."""

    kind: str = "none"
    cap: float = 2.0
    cap_low: float | None = None  # lower threshold 1 / cap_low (icepop, geo_mask); None: cap
    seq_ratio: str = "product"

    @property
    def active(self) -> bool:
        return self.kind != "none"


def resolve_correction(
    kind: str,
    cap: float = 2.0,
    cap_low: float | None = None,
    seq_ratio: str = "product",
    use_decoupled_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    where: str = "PPOActorConfig",
) -> Correction:
    """The correction a config asks for; a bad value raises a one-line ValueError naming the field.

    ``auto`` keeps the legacy decoupled-PPO fields working: with ``use_decoupled_loss`` it is
    ``mis`` at ``C = behav_imp_weight_cap`` (untruncated ``tis`` when no cap is set), else token
    ``tis`` at ``cap`` (2 by default: a weight above 2 means the server sampled the token at
    under half the trainer's probability, and bounding it keeps the variance low while
    the bias stays small). Those legacy fields are read only under ``auto``.
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"{where}.offpolicy_correction: '{kind}' is not one of {', '.join(CORRECTIONS)}")
    if not cap >= 1.0:
        raise ValueError(f"{where}.offpolicy_cap must be >= 1, got {cap}")
    if cap_low is not None and not cap_low >= 1.0:
        raise ValueError(f"{where}.offpolicy_cap_low must be >= 1 (the lower threshold is 1/cap_low), got {cap_low}")
    if seq_ratio not in SEQ_RATIOS:
        raise ValueError(f"{where}.offpolicy_seq_ratio: '{seq_ratio}' is not one of {', '.join(SEQ_RATIOS)}")
    if kind == "none" and use_decoupled_loss:
        raise ValueError(f"{where}.offpolicy_correction: 'none' contradicts use_decoupled_loss=true")
    if kind != "auto":
        return Correction(kind, cap, cap_low, seq_ratio)
    if not use_decoupled_loss:
        return Correction(AUTO_KIND, cap, cap_low, seq_ratio)
    if behav_imp_weight_cap is None:
        return Correction("tis", math.inf)
    if not behav_imp_weight_cap > 0:
        raise ValueError(f"{where}.behav_imp_weight_cap must be > 0, got {behav_imp_weight_cap}")
    return Correction("mis", behav_imp_weight_cap)


def old_policy_logp(correction: Correction, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None) -> torch.Tensor:
    """The old policy of the PPO ratio ``exp(logp - old)``.

    ``none``: the behaviour logprobs, whatever was recomputed: PPO's ratio and clip then act
    against the policy that sampled the tokens (stale ones included), the only importance
    weighting this kind has; the recomputed proximal logprobs would make every ratio of a
    one-step update 1 and train stale samples as on-policy. Any other kind: ``prox_logp``
    (the correction weighs the proximal/behaviour gap separately); ``None`` there means the
    update's own forward is the proximal policy (a one-step update), and the behaviour
    logprobs stand in only as a placeholder the loss replaces.
    """
    if not correction.active or prox_logp is None:
        return behav_logp
    return prox_logp


def _log_ratio(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, m: torch.Tensor, c: Correction, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """log rho per token, or the sequence's log R / log G broadcast to its tokens (0 off ``m``)."""
    lr = prox_logp.detach().float() - behav_logp.detach().float()
    lr = torch.where(m & torch.isfinite(lr), lr, 0.0)
    if c.kind not in _SEQUENCE_KINDS:
        return lr
    total = per_sequence_sum(lr, cu_seqlens)
    if c.kind == "geo_mask" or c.seq_ratio == "geometric":
        total = total / per_sequence_sum(m.to(lr.dtype), cu_seqlens).clamp(min=1)
    return torch.where(m, broadcast_to_tokens(total, lr, cu_seqlens), 0.0)


def correction_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    cu_seqlens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached per-token weights of ``correction`` (padded [B, L] or packed 1-D with ``cu_seqlens``).

    Returns ``weight`` (0 off ``mask`` and on dropped tokens), ``kept`` (in ``mask`` and not
    dropped), ``truncated`` (the weight was cut to C) and ``log_ratio`` (the log of the ratio the
    kind uses), all shaped like ``mask``. A token whose log-ratio is not finite (a logprob of
    ``-inf`` on either side, e.g. both -inf gives NaN) is dropped by every active kind, and left
    out of its sequence's ratio.
    """
    m = mask.bool()
    if correction.active:
        m = m & torch.isfinite(prox_logp.detach().float() - behav_logp.detach().float())
    lr = _log_ratio(prox_logp, behav_logp, m, correction, cu_seqlens)
    no = torch.zeros_like(m)
    if not correction.active:
        return {"weight": m.float(), "kept": m.clone(), "truncated": no, "log_ratio": lr}
    log_hi = math.log(correction.cap)
    if correction.kind in _TRUNCATING:
        truncated = m & (lr > log_hi)
        return {
            "weight": torch.where(m, lr.clamp(max=log_hi).exp(), 0.0),
            "kept": m,
            "truncated": truncated,
            "log_ratio": lr,
        }
    kept = m & (lr <= log_hi)
    if correction.kind in _TWO_SIDED:
        log_lo = -math.log(correction.cap if correction.cap_low is None else correction.cap_low)
        kept = kept & (lr >= log_lo)
    return {
        "weight": torch.where(kept, lr.clamp(max=log_hi).exp(), 0.0),
        "kept": kept,
        "truncated": no,
        "log_ratio": lr,
    }


def cispo_objective(
    logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` and its clip mask.

    The gradient is ``-clip(r) * A * grad logp`` for every token, clipped or not: the clip bounds
    the weight, it never zeroes the token's gradient (unlike PPO's surrogate).
    """
    r = ratio.detach()
    clipped = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -clipped * advantages * logp.float(), (r < 1.0 - eps_low) | (r > 1.0 + eps_high)


def mismatch_token_stats(
    trainer_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per token on ``mask`` (0 elsewhere, and where either logprob is infinite): ``abs_dlogp =
    |trainer - behaviour|`` and ``kl_k3``, the k3 estimate of KL(behaviour || trainer) from the
    behaviour's own samples."""
    t, b = trainer_logp.detach().float(), behav_logp.detach().float()
    m = mask.bool() & torch.isfinite(t - b)
    return {
        "abs_dlogp": torch.where(m, (t - b).abs(), 0.0),
        "kl_k3": torch.where(m, kl_estimate(b, t, "k3"), 0.0),
    }


def version_stats(versions: torch.Tensor, mask: torch.Tensor, current_version: int) -> dict[str, torch.Tensor]:
    """Staleness of a padded [B, L] batch from the per-token weight ``versions`` on ``mask`` (generated tokens).

    ``has_tokens`` [B]: rows with a masked token; ``lag`` [B]: ``current_version - min version``
    of the row (0 where it has none); ``multi_version`` [B, L]: masked tokens of rows whose
    tokens came from more than one version (a generation interrupted by a weight update).
    """
    if versions.shape != mask.shape:
        raise ValueError(f"batch field 'versions' has shape {tuple(versions.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()
    v = versions.long()
    has = m.any(dim=1)
    lo = torch.where(m, v, torch.iinfo(torch.long).max).min(dim=1).values
    hi = torch.where(m, v, torch.iinfo(torch.long).min).max(dim=1).values
    lag = torch.where(has, current_version - lo, 0).float()
    return {"has_tokens": has, "lag": lag, "multi_version": m & (hi > lo)[:, None]}
