"""How per-token losses become one scalar, and the matching weight across micro-batches.

An engine sums ``loss(mb) * weight(mb) / sum(weights)`` over micro-batches and ranks, so a
mode's weight must count what its loss averages over; then the result equals the loss of
the whole batch, whatever the split.
"""

from __future__ import annotations

import torch

from tandemrl.algorithms.layout import per_sequence_sum

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _check(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got '{mode}'")


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    norm_len: float = 1.0,
) -> torch.Tensor:
    """Reduce per-token losses over ``mask`` (padded [B, L] rows or packed 1-D with ``cu_seqlens``).

    * token-mean:          sum_{i,t} l / n_tokens                          (every token weighs the same)
    * seq-mean-token-mean: mean_i (sum_t l_{i,t} / n_tokens_i)             (every sequence weighs the same)
    * seq-mean-token-sum:  mean_i (sum_t l_{i,t} / norm_len)               (Dr.GRPO: norm_len = max_new_tokens)

    Sequences without masked tokens are left out; an empty mask gives 0.
    """
    _check(mode)
    m = mask.bool()
    masked = torch.where(m, per_token, 0.0)
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    seq_sum = per_sequence_sum(masked, cu_seqlens)
    seq_cnt = per_sequence_sum(m.to(masked.dtype), cu_seqlens)
    has = seq_cnt > 0
    per_seq = seq_sum / seq_cnt.clamp(min=1) if mode == "seq-mean-token-mean" else seq_sum / norm_len
    return torch.where(has, per_seq, 0.0).sum() / has.sum().clamp(min=1)


def aggregation_weight(mask: torch.Tensor, mode: str = "token-mean", cu_seqlens: torch.Tensor | None = None) -> int:
    """Weight of a micro-batch's aggregated loss: its masked tokens (token-mean) or its sequences with any."""
    _check(mode)
    m = mask.bool()
    if mode == "token-mean":
        return int(m.sum())
    return int((per_sequence_sum(m.long(), cu_seqlens) > 0).sum())
