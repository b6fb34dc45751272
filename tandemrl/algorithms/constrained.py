"""Constrained decoding (structured outputs): which generated tokens the constraint forced.

A call sent with an output constraint (vLLM ``structured_outputs``: a regex, a choice, a JSON
schema; the agent proxy's ``response_format``) is sampled from the *constrained* distribution:
the model's logits with every token the grammar forbids removed. The server's logprobs
(``logprobs_mode=processed_logprobs``) are of that distribution. Where the grammar allows a
single token, the distribution is a point mass and the behaviour logprob is exactly 0.0
(``log_softmax`` over one finite logit), whatever the weights: the token was *forced*.

A forced token carries no choice of the policy, so the trainer leaves it out of the update
(see docs/agents.md, "Constrained outputs"). Its importance ratio ``exp(trainer - 0)`` is the
unconstrained probability of a token the sampler could not avoid, not a ratio of two policies
(a forced token the model finds unlikely would drag every correction weight of the batch towards
0); and the score of the constrained policy at a forced token is 0 (its probability is 1 for all
weights), so a policy-gradient term there would only push the unconstrained model towards the
grammar's tokens with an advantage earned by the other tokens.

The rollout marks the tokens of constrained calls (batch field ``constrained``, token-aligned
like ``loss_mask``); a token of such a call is forced iff its behaviour logprob is exactly 0.0.
Without a constraint a logprob of 0.0 is a real choice (greedy, top-k = 1, a confident model)
and is kept. Pure tensor functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tandemrl.algorithms.layout import shift_left
from tandemrl.api.types import RolloutBatch

# The trainer warns when more than this fraction of a batch's generated tokens were forced.
FORCED_WARN_FRACTION = 0.5


def forced_tokens(behav_logp: torch.Tensor, constrained: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Bool mask shaped like ``mask``: tokens on ``mask`` of a ``constrained`` call whose behaviour
    logprob is exactly 0.0 (the constraint allowed no other token). All three share one alignment."""
    if not behav_logp.shape == constrained.shape == mask.shape:
        raise ValueError(
            f"batch field 'constrained' has shape {tuple(constrained.shape)}; "
            f"logprobs {tuple(behav_logp.shape)}, mask {tuple(mask.shape)}"
        )
    return mask.bool() & constrained.bool() & (behav_logp == 0.0)


def forced_actions(batch: RolloutBatch | Mapping[str, torch.Tensor], action_mask: torch.Tensor) -> torch.Tensor | None:
    """Next-token aligned forced mask of a padded rollout batch (its ``logprobs`` and ``constrained``),
    within ``action_mask``; None when the batch has no ``constrained`` field (no constrained call)."""
    if "constrained" not in batch:
        return None
    constrained = batch["constrained"]
    if constrained.shape != batch["logprobs"].shape:
        raise ValueError(
            f"batch field 'constrained' has shape {tuple(constrained.shape)}, "
            f"'logprobs' {tuple(batch['logprobs'].shape)}"
        )
    behav = shift_left(batch["logprobs"].float())
    return forced_tokens(behav, shift_left(constrained.bool(), fill=False), action_mask)


def limited_actions(batch: RolloutBatch | Mapping[str, torch.Tensor], action_mask: torch.Tensor) -> torch.Tensor | None:
    """Next-token aligned mask of the actions (``action_mask``, forced tokens already out of it) of constrained
    calls: tokens the grammar limited without forcing; None when the batch has no ``constrained`` field."""
    if "constrained" not in batch:
        return None
    return shift_left(batch["constrained"].bool(), fill=False) & action_mask.bool()


def behaviour_for_weights(
    behav_logp: torch.Tensor, trainer_logp: torch.Tensor, limited: torch.Tensor | None
) -> torch.Tensor:
    """The behaviour logprobs the importance weights compare against: the server's, except at ``limited``
    tokens, where they are the trainer's own (detached) proximal logprobs, so those tokens weigh 1.

    The server's logprob there is of the constrained distribution ``p(a) / p(A)`` (A: the tokens the grammar
    allowed, unknown to the trainer), the trainer's of the unconstrained ``p(a)``: their ratio is the
    allowed mass ``p(A)`` (0.005-0.01 measured on the agent example), not a change of policy. On-policy the
    constrained policies' ratio is exactly 1; what staleness changes in it cannot be computed without A, so
    those tokens are left out of the importance weight (docs/offpolicy.md, "Constrained tokens")."""
    if limited is None:
        return behav_logp
    return torch.where(limited, trainer_logp.detach().to(behav_logp.dtype), behav_logp)


def mostly_forced(n_forced: float, n_generated: float, fraction: float = FORCED_WARN_FRACTION) -> bool:
    """Whether more than ``fraction`` of ``n_generated`` tokens were forced (False with none generated)."""
    return n_generated > 0 and n_forced > fraction * n_generated
