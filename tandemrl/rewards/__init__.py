"""Reward functions and the runner that calls them safely off the event loop."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "gsm8k_reward_fn": "tandemrl.rewards.gsm8k",
    "RewardRunner": "tandemrl.rewards.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandemrl.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
