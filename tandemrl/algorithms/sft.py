"""Supervised fine-tuning written once against the TrainEngine contract: the next-token loss on packed
sequences and ``SFTActor(engine)``, which trains and evaluates with it on any backend."""

from __future__ import annotations

import torch

from tandemrl.api.engine import TrainEngine
from tandemrl.api.types import TensorDict
from tandemrl.models.functional import gather_logprobs, next_token_labels, next_token_mask
from tandemrl.utils import stats_tracker


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


def _lm_loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    logp, mask = sft_token_logprobs(logits, mb["input_ids"], mb["loss_mask"], mb["cu_seqlens"])
    stats_tracker.denominator(n_tokens=torch.ones_like(mask), n_loss_tokens=mask)
    stats_tracker.stat(ppl_logp=logp.detach(), denominator="n_loss_tokens")
    return sft_loss(logits, mb["input_ids"], mb["loss_mask"], mb["cu_seqlens"])


def _lm_weight(mb: TensorDict) -> torch.Tensor:
    return sft_loss_weight(mb["loss_mask"], mb["cu_seqlens"])


class SFTActor:
    """Next-token training and evaluation on padded batches with a ``loss_mask``."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def train_lm(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step of SFT on the masked tokens; returns the step statistics."""
        self.engine.train()
        with stats_tracker.scope("sft"):
            return self.engine.train_batch(batch, loss_fn=_lm_loss, loss_weight_fn=_lm_weight)

    def evaluate_lm(self, batch: TensorDict) -> float:
        """Token-weighted mean loss over the batch on all DP ranks."""
        self.engine.eval()
        with stats_tracker.scope("sft_eval"):
            loss = self.engine.eval_batch(batch, loss_fn=_lm_loss, loss_weight_fn=_lm_weight)
        return float(loss)
