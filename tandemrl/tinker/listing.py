"""The REST listing routes of ``tandemrl tinker-serve`` (the SDK's ``RestClient``): training runs and their checkpoints.

A training run is a training client (its id is the model id); it stays listed after it is unloaded.
A checkpoint is a ``save_state`` (type ``training``) or ``save_weights_for_sampler`` (``sampler``)
directory, listed under the id the SDK parses from its path (``weights/<name>``, ``sampler_weights/<name>``).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any

from tandemrl.tinker.wire import NotFound, UserError

KINDS = {"weights": "training", "sampler_weights": "sampler"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


class Listing:
    """Training runs and checkpoints as the SDK's ``TrainingRun`` / ``Checkpoint`` JSON."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.runs: dict[str, dict[str, Any]] = {}
        self.checkpoints: dict[str, list[dict[str, Any]]] = {}

    def add_run(self, model_id: str, rank: int | None, metadata: dict[str, str] | None) -> None:
        self.runs[model_id] = {
            "training_run_id": model_id,
            "base_model": self.model_name,
            "model_owner": "tandemrl",
            "is_lora": rank is not None,
            "lora_rank": rank,
            "last_request_time": _now(),
            "last_checkpoint": None,
            "last_sampler_checkpoint": None,
            "user_metadata": metadata,
        }
        self.checkpoints[model_id] = []

    def touch(self, model_id: str) -> None:
        if model_id in self.runs:
            self.runs[model_id]["last_request_time"] = _now()

    def add_checkpoint(self, path: str, directory: str) -> None:
        model_id, kind, name = path.removeprefix("tinker://").split("/")
        entry = {
            "checkpoint_id": f"{kind}/{name}",
            "checkpoint_type": KINDS[kind],
            "time": _now(),
            "tinker_path": path,
            "size_bytes": _size(directory),
        }
        listed = [c for c in self.checkpoints.setdefault(model_id, []) if c["tinker_path"] != path]
        self.checkpoints[model_id] = [*listed, entry]
        if model_id in self.runs:
            self.runs[model_id]["last_checkpoint" if kind == "weights" else "last_sampler_checkpoint"] = entry

    def run(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.runs:
            raise NotFound(f"training_run_id: unknown training run {model_id!r}")
        return self.runs[model_id]

    def list_runs(self, limit: str | None, offset: str | None) -> dict[str, Any]:
        try:
            lim, off = int(limit or 20), int(offset or 0)
        except ValueError:
            raise UserError(f"limit/offset: not integers ({limit!r}, {offset!r})") from None
        runs = list(self.runs.values())
        return {
            "training_runs": runs[off : off + lim],
            "cursor": {"offset": off, "limit": lim, "total_count": len(runs)},
        }

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        self.run(model_id)
        return {"checkpoints": self.checkpoints[model_id]}
