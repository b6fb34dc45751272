"""Reward shaping on per-sequence rewards [B] and their placement on tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shape_rewards(
    rewards: torch.Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """``clamp((r + bias) * scaling, -clip, clip)``; ``clip=None`` does not clip."""
    out = (rewards.float() + bias) * scaling
    return out if clip is None else out.clamp(-clip, clip)


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (<= 0) added to the reward of each response.

    With ``L_safe = max_len - buffer``: 0 for ``L <= L_safe``, ``(L_safe - L) / buffer * factor``
    (linear from 0 to ``-factor``) inside the last ``buffer`` tokens, ``-factor`` beyond ``max_len``.
    """
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong_penalty: buffer must be in [1, max_len={max_len}], got {buffer}")
    lengths = response_lengths.float()
    safe = max_len - buffer
    penalty = (safe - lengths) / buffer * factor
    return penalty.clamp(min=-factor, max=0.0)


def response_ends_with_eos(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Bool [B]: the last generated token (last ``loss_mask`` position) is an EOS/stop token.

    Rows without generated tokens are False.
    """
    if not eos_token_ids:
        raise ValueError("response_ends_with_eos: eos_token_ids is empty")
    m = loss_mask.bool()
    has = m.any(dim=1)
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos, -1).max(dim=1).values.clamp(min=0)
    last_tok = input_ids.gather(1, last[:, None]).squeeze(1)
    eos = torch.as_tensor(list(eos_token_ids), dtype=last_tok.dtype, device=last_tok.device)
    return has & torch.isin(last_tok, eos)


def apply_no_eos_penalty(rewards: torch.Tensor, ended: torch.Tensor, penalty: float) -> torch.Tensor:
    """Replace the reward of responses that did not end with EOS (truncated) by ``penalty``."""
    return torch.where(ended.bool(), rewards.float(), torch.full_like(rewards.float(), penalty))


def place_at_last_token(seq_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, L]: each row's reward at its last masked (action) position, 0 elsewhere."""
    m = mask.bool()
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos, -1).max(dim=1).values
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = seq_rewards.float().to(m.device)[rows]
    return out
