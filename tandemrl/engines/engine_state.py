"""What a recoverable checkpoint holds besides weights and optimizer: version, LR schedule, origin.

Every backend writes the same two files next to its own weight/optimizer files, so resuming
restores the version and schedule the same way and a checkpoint of another backend is
refused with a clear message instead of a library traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

META_FILE = "engine_meta.json"
STATE_FILE = "engine_state.pt"


def save_engine_state(
    path: str, backend: str, version: int, lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None, with_optim: bool
) -> None:
    """Write the engine's version, LR-schedule state and the checkpoint's origin; call on one rank only."""
    os.makedirs(path, exist_ok=True)
    extra: dict[str, Any] = {"version": version}
    if lr_scheduler is not None:
        extra["lr_scheduler"] = lr_scheduler.state_dict()
    torch.save(extra, os.path.join(path, STATE_FILE))
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"with_optim": with_optim, "backend": backend}, f)


def read_engine_meta(path: str, backend: str) -> dict[str, Any]:
    """``{"with_optim", "backend"}`` of the checkpoint at ``path``; it must come from ``backend``."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: {path} is not a recoverable (dcp) engine checkpoint")
    with open(meta_path) as f:
        info = json.load(f)
    if info.get("backend", backend) != backend:
        raise ValueError(
            f"checkpoint {path} was written by the {info['backend']} backend, cannot load it into {backend}"
        )
    return info


def load_engine_state(path: str, lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> int:
    """Restore the LR schedule (if both sides have one) and its current lr; returns the saved version."""
    extra = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
    if lr_scheduler is not None and "lr_scheduler" in extra:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
        # load_state_dict does not touch the optimizer: set the lr the schedule had reached.
        for group, lr in zip(lr_scheduler.optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    return int(extra["version"])
