"""Supervised (next-token) loss on packed sequences."""

from __future__ import annotations

import torch

from tandemrl.models.functional import gather_logprobs, next_token_labels, next_token_mask


def sft_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs of a packed micro-batch and the mask of positions that count."""
    logp = gather_logprobs(logits, next_token_labels(input_ids, cu_seqlens))
    return logp, next_token_mask(loss_mask, cu_seqlens)


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Mean negative log-likelihood over the tokens whose ``loss_mask`` is set."""
    logp, mask = sft_token_logprobs(logits, input_ids, loss_mask, cu_seqlens)
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def sft_loss_weight(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Number of tokens that count in :func:`sft_loss` (its weight across micro-batches)."""
    return next_token_mask(loss_mask, cu_seqlens).sum()
