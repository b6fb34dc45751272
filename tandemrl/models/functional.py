"""Token-level helpers shared by loss functions on packed micro-batches."""

from __future__ import annotations

import torch


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Label of every packed position: the next token of the same sequence.

    The last position of each sequence has no next token; it gets its own id and must
    be masked out (see :func:`next_token_mask`).
    """
    labels = torch.roll(input_ids, shifts=-1, dims=0)
    ends = cu_seqlens[1:].long() - 1
    labels[ends] = input_ids[ends]
    return labels


def next_token_mask(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Which packed positions predict a token that counts in the loss.

    Position i predicts token i+1, so the mask is shifted left by one within each
    sequence and is False at each sequence's last position.
    """
    shifted = torch.roll(loss_mask.bool(), shifts=-1, dims=0)
    shifted[cu_seqlens[1:].long() - 1] = False
    return shifted


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) under softmax(logits / temperature), computed in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label log-probabilities and the entropy of each position's distribution."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1), entropy
