"""Rollout workflows and the executor that streams them; names load lazily on first access."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutWorkflow": "tandemrl.api.workflow",
    "GenerationEngine": "tandemrl.api.workflow",
    "StalenessManager": "tandemrl.workflows.staleness",
    "RolloutStat": "tandemrl.workflows.staleness",
    "WorkflowExecutor": "tandemrl.workflows.executor",
    "AsyncTaskRunner": "tandemrl.workflows.executor",
    "RLVRWorkflow": "tandemrl.workflows.rlvr",
    "ReMaxRLVRWorkflow": "tandemrl.workflows.remax",
    "MultiTurnWorkflow": "tandemrl.workflows.multi_turn",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandemrl.workflows' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
