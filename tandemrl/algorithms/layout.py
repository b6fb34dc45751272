"""Per-token layouts used by the RL losses: padded [B, L] rows or packed 1-D with ``cu_seqlens``.

Two alignments exist for per-token fields of a padded batch:

* token-aligned (rollout): ``x[:, t]`` is about token t, e.g. ``logprobs[:, t] = log p(token t | < t)``
  and ``loss_mask[:, t] = 1`` on generated tokens;
* next-token (action) aligned (trainer): ``x[:, t]`` is about the action taken at position t,
  i.e. emitting token t + 1 from prefix ``<= t``. Logits at position t give this directly.

:func:`shift_left` converts the first into the second.
"""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Token-aligned [B, L, ...] -> next-token aligned: ``out[:, t] = x[:, t + 1]``, last column ``fill``."""
    if x.dim() < 2:
        raise ValueError(f"shift_left: expected a padded [B, L] tensor, got shape {tuple(x.shape)}")
    out = torch.full_like(x, fill)
    out[:, :-1] = x[:, 1:]
    return out


def sequence_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence number of every packed token, e.g. cu_seqlens [0, 2, 5] -> [0, 0, 1, 1, 1]."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), lens)


def per_sequence_sum(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of each sequence's tokens: rows of a padded [B, L] tensor, or packed segments. Differentiable."""
    if cu_seqlens is None:
        if x.dim() != 2:
            raise ValueError(f"per_sequence_sum: padded input must be [B, L], got shape {tuple(x.shape)}")
        return x.sum(dim=1)
    if x.dim() != 1:
        raise ValueError(f"per_sequence_sum: packed input must be 1-D, got shape {tuple(x.shape)}")
    n = len(cu_seqlens) - 1
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, sequence_index(cu_seqlens), x)


def broadcast_to_tokens(v: torch.Tensor, like: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence values [n] repeated over each sequence's tokens (padded rows or packed segments)."""
    if cu_seqlens is None:
        return v[:, None].expand_as(like)
    return v[sequence_index(cu_seqlens)]


def packed_to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed [T] -> right-padded [n, max_len] (one row per sequence)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n, width = len(lens), int(lens.max()) if len(lens) else 0
    out = torch.full((n, width), fill, dtype=x.dtype, device=x.device)
    valid = torch.arange(width, device=x.device)[None, :] < lens[:, None].to(x.device)
    out[valid] = x
    return out


def padded_to_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`packed_to_padded`."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(x.device)
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < lens[:, None]
    return x[valid]
