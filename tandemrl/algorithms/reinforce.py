"""REINFORCE with a reward-difference signal (e.g. ReMax), written once against TrainEngine (any backend)."""

from __future__ import annotations

import torch

from tandemrl.algorithms.layout import shift_left
from tandemrl.algorithms.policy_loss import reinforce_loss
from tandemrl.algorithms.ppo import action_mask_of, record_routing, require_fields
from tandemrl.api.engine import TrainEngine
from tandemrl.api.types import ROUTED_EXPERTS, RolloutBatch, TensorDict
from tandemrl.models.functional import gather_logprobs, next_token_labels
from tandemrl.utils import stats_tracker


def _loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    logp = gather_logprobs(logits, next_token_labels(mb["input_ids"], mb["cu_seqlens"]))
    mask = mb["action_mask"].bool()
    stats_tracker.denominator(n_action_tokens=mask)
    stats_tracker.stat(denominator="n_action_tokens", advantages=mb["advantages"].float(), logp=logp.detach())
    return reinforce_loss(logp, mb["advantages"], mask)


def _weight(mb: TensorDict) -> int:
    return int(mb["action_mask"].sum())


def reinforce_advantages(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, action mask), next-token aligned, from ``rewards`` [B] or token-aligned [B, L].

    A per-sequence reward (ReMaxRLVRWorkflow: ``r(sample) - r(greedy)``) applies to every
    generated token; a per-token tensor is shifted to the action layout.
    """
    action = action_mask_of(batch)
    rewards = batch["rewards"].float().to(action.device)
    if rewards.shape == action.shape:
        adv = shift_left(rewards)
    elif tuple(rewards.shape) == (action.shape[0],):
        adv = rewards[:, None].expand_as(action)
    else:
        raise ValueError(
            f"batch field 'rewards' must be [B] or [B, L] = {tuple(action.shape)}, got {tuple(rewards.shape)}"
        )
    return torch.where(action, adv, 0.0), action


class ReinforceActor:
    """One optimizer step of ``-A * log p(token)`` averaged over generated tokens."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def train_reinforce(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on ``input_ids``/``attention_mask``/``loss_mask``/``rewards``; returns the step stats."""
        require_fields(batch, ("input_ids", "attention_mask", "loss_mask", "rewards"), "train_reinforce")
        adv, action = reinforce_advantages(batch)
        data = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "action_mask": action,
            "advantages": adv,
        }
        if getattr(self.engine, "router_replay", False):  # MoE routing replay (docs/moe.md)
            record_routing(self.engine, batch)
            data[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS]  # type: ignore[typeddict-item]
        self.engine.train()
        with stats_tracker.scope("reinforce"):
            return self.engine.train_batch(data, loss_fn=_loss, loss_weight_fn=_weight)
