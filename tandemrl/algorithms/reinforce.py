"""REINFORCE with a reward-difference signal (e.g. ReMax), written once against TrainEngine (any backend).

``ReinforceActor(config.actor, engine)`` reads three things of the actor's config: the sampling
``temperature``, the truncation replay (``truncation_replay`` + ``top_k``/``top_p``/``min_p``)
and ``offpolicy_correction``. Each token's loss is ``-w * A * log p`` with ``w`` the detached
correction weight on ``rho = exp(log p - behaviour log p)`` (the update is one optimizer step,
so its own forward is the proximal policy); ``w = 1`` with ``none``, which is refused on a batch
whose tokens came from older weights than the trainer's (it would train them as on-policy), and
before that when the config loads, by :func:`config_problem` (a script passes it as ``checks``).
"""

from __future__ import annotations

import torch

from tandemrl.algorithms.aggregation import aggregate_loss
from tandemrl.algorithms.constrained import behaviour_for_weights, forced_actions, limited_actions
from tandemrl.algorithms.layout import shift_left
from tandemrl.algorithms.offpolicy import Correction, correction_weights
from tandemrl.algorithms.ppo import action_mask_of, correction_of, record_routing, require_fields
from tandemrl.algorithms.recompute import needs_logp_recompute, server_logp
from tandemrl.algorithms.truncation import Truncation, policy_logprobs, replay_of
from tandemrl.api.engine import TrainEngine
from tandemrl.api.renamed import RENAMED_IN
from tandemrl.api.types import ROUTED_EXPERTS, RolloutBatch, TensorDict
from tandemrl.configs.experiment import GRPOConfig, async_enabled
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.models.functional import next_token_labels
from tandemrl.utils import stats_tracker


def config_problem(config: GRPOConfig) -> tuple[str, str] | None:
    """The check a REINFORCE script passes to ``load_config`` (``checks=``), so the launchers' pre-flight refuses
    what :meth:`ReinforceActor.train_reinforce` would refuse at the first stale batch: ``offpolicy_correction``
    ``none`` with asynchronous training (samples from older weights than the trainer's)."""
    rollout = config.rollout
    if config.actor.offpolicy_correction != "none" or not async_enabled(config):
        return None
    return (
        "actor.offpolicy_correction",
        f"is 'none' but training is asynchronous (rollout.max_head_offpolicyness={rollout.max_head_offpolicyness}): "
        "ReinforceActor would train samples from older weights as on-policy; choose a correction (auto: tis) or "
        "async_training=false",
    )


def reinforce_corrected_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    behav_logp: torch.Tensor | None,
    correction: Correction,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, weight)``: token mean of ``-w * A * logp`` over ``mask``, ``w`` the detached weight of
    ``correction`` on ``exp(logp - behav_logp)`` (1 without ``behav_logp`` or with ``none``)."""
    m = mask.bool()
    weight = m.float()
    if behav_logp is not None and correction.active:
        weight = correction_weights(logp.detach(), behav_logp, m, correction, cu_seqlens)["weight"]
    live = m & (weight > 0)  # a dropped token (w = 0, maybe logp = -inf) sends no gradient
    per_token = torch.where(live, -weight * advantages.float() * logp.float(), 0.0)
    return aggregate_loss(per_token, m, "token-mean"), weight


class _Loss:
    """The per-micro-batch loss at the sampling temperature, under the sampler's truncation."""

    def __init__(self, temperature: float, replay: Truncation | None, correction: Correction):
        self.temperature, self.replay, self.correction = temperature, replay, correction

    def __call__(self, logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        labels = next_token_labels(mb["input_ids"], mb["cu_seqlens"])
        logp = policy_logprobs(logits, labels, self.temperature, self.replay)[0]
        mask = mb["action_mask"].bool()
        behav = mb.get("behav_logp")
        if behav is not None:  # one optimizer step: this forward is the proximal policy; constrained tokens weigh 1
            behav = behaviour_for_weights(behav, logp, mb.get("limited_mask"))
        loss, weight = reinforce_corrected_loss(logp, mb["advantages"], mask, behav, self.correction, mb["cu_seqlens"])
        stats_tracker.denominator(n_action_tokens=mask)
        stats_tracker.stat(
            denominator="n_action_tokens",
            advantages=mb["advantages"].float(),
            logp=torch.where(mask, logp.detach(), 0.0),
            behav_imp_weight=weight,
        )
        return loss


def _weight(mb: TensorDict) -> int:
    return int(mb["action_mask"].sum())


def reinforce_advantages(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, action mask), next-token aligned, from ``rewards`` [B] or token-aligned [B, L].

    A per-sequence reward (ReMaxRLVRWorkflow: ``r(sample) - r(greedy)``) applies to every
    generated token; a per-token tensor is shifted to the action layout. Tokens an output
    constraint forced (batch field ``constrained``) are not actions.
    """
    action = action_mask_of(batch)
    forced = forced_actions(batch, action)  # tokens an output constraint forced carry no choice (constrained.py)
    if forced is not None:
        action = action & ~forced
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
    """One optimizer step of ``-w * A * log p(token)`` averaged over generated tokens (module docstring)."""

    def __init__(self, config: PPOActorConfig, engine: TrainEngine):
        if not isinstance(config, PPOActorConfig):  # the order was (engine, config) before RENAMED_IN
            raise TypeError(
                f"ReinforceActor(config, engine): config must be a PPOActorConfig, got {type(config).__name__} "
                f"(the arguments are in PPOActor's order since tandemrl {RENAMED_IN})"
            )
        self.engine = engine
        self.config = config
        self.correction = correction_of(config)
        self.loss = _Loss(config.temperature, replay_of(config), self.correction)

    def train_reinforce(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on ``input_ids``/``attention_mask``/``loss_mask``/``rewards`` (+ the server's ``logprobs``
        for the correction, ``versions`` for the staleness check); returns the step stats."""
        require_fields(batch, ("input_ids", "attention_mask", "loss_mask", "rewards"), "train_reinforce")
        adv, action = reinforce_advantages(batch)
        versions = batch["versions"] if "versions" in batch else None
        if not self.correction.active and versions is not None:
            if needs_logp_recompute("auto", versions, batch["loss_mask"], self.engine.get_version()):
                raise ValueError(
                    "ReinforceActor: actor.offpolicy_correction 'none' on samples from older weights than the "
                    "trainer's (async training) would train them as on-policy; choose a correction (auto: tis)"
                )
        data = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "action_mask": action,
            "advantages": adv,
        }
        if self.correction.active:
            require_fields(batch, ("logprobs",), "train_reinforce", f" ({self.correction.kind} needs the server's)")
            data["behav_logp"] = server_logp(batch["logprobs"], action)
            limited = limited_actions(batch, action)  # tokens of constrained calls (constrained.py)
            if limited is not None:
                data["limited_mask"] = limited
        if self.engine.router_replay:  # MoE routing replay (docs/moe.md)
            record_routing(self.engine, batch)
            data[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS]
        self.engine.train()
        with stats_tracker.scope("reinforce"):
            return self.engine.train_batch(data, loss_fn=self.loss, loss_weight_fn=_weight)
