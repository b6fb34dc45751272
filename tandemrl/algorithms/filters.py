"""Rollout filters usable as ``should_accept_fn`` (dynamic sampling)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def reject_uniform_rewards(traj: Mapping[str, torch.Tensor]) -> bool:
    """DAPO dynamic sampling: accept a group only if its rewards are not all equal.

    A group whose samples all got the same reward has zero group-normalized advantage and
    trains nothing. Returns True to accept. Needs ``group_size > 1``: a single sample is
    always uniform and would never be accepted.
    """
    if "rewards" not in traj:
        raise KeyError(f"reject_uniform_rewards: trajectory has no 'rewards' (fields: {sorted(traj)})")
    rewards = traj["rewards"].float().flatten()
    return rewards.numel() > 1 and bool(rewards.max() > rewards.min())
