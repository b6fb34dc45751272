"""Rollout workflows (one dataset row -> training data); names load lazily on first access.

The executor that runs them lives in ``tandemrl.rollout``.
"""

from __future__ import annotations

import importlib
from typing import Any

from tandemrl.api.renamed import retired_names

_EXPORTS = {
    "RolloutWorkflow": "tandemrl.api.workflow",
    "GenerationClient": "tandemrl.api.workflow",
    "RLVRWorkflow": "tandemrl.workflows.rlvr",
    "ReMaxRLVRWorkflow": "tandemrl.workflows.remax",
    "MultiTurnWorkflow": "tandemrl.workflows.multi_turn",
    "AgentWorkflow": "tandemrl.workflows.agent",
    "AgentProxy": "tandemrl.workflows.proxy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        return retired_names(__name__)(name)  # an old name fails with the line naming the new one
    return getattr(importlib.import_module(module), name)
