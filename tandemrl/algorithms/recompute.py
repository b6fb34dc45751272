"""When the trainer must recompute the proximal (pre-update) logprobs, and what to use when it need not.

A batch is on-policy when every generated token was sampled by the weights the trainer holds
now (``versions`` equals the engine's version on every ``loss_mask`` token). Then the policy
before the update *is* the behaviour policy, and the server's logprobs stand in for the extra
forward pass. One stale token makes the recompute necessary (decoupled PPO weighs by
``exp(prox - behav)``).
"""

from __future__ import annotations

import torch

from tandemrl.algorithms.layout import shift_left

RECOMPUTE_MODES = ("auto", "always", "never")


def needs_logp_recompute(
    mode: str, versions: torch.Tensor | None, loss_mask: torch.Tensor, current_version: int
) -> bool:
    """Whether this batch needs ``compute_logp`` before the update.

    ``mode``: ``always`` / ``never`` decide alone; ``auto`` recomputes unless every generated
    token (``loss_mask``) has ``versions == current_version``. Missing ``versions`` (a workflow
    that does not label tokens) counts as off-policy; a batch with no generated token as on-policy.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute_logprob: '{mode}' is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode != "auto":
        return mode == "always"
    if versions is None:
        return True
    if versions.shape != loss_mask.shape:
        raise ValueError(
            f"batch field 'versions' has shape {tuple(versions.shape)}, 'loss_mask' {tuple(loss_mask.shape)}"
        )
    generated = versions[loss_mask.bool()]
    return bool((generated != current_version).any())


def server_logp(logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """The rollout's token-aligned ``logprobs`` as next-token aligned logprobs (0 off the actions)."""
    return torch.where(action_mask.bool(), shift_left(logprobs.float()), 0.0)
