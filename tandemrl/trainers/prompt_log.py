"""Which prompts each RL step trained on: one JSON line per step, ``prompt_ids.jsonl`` in the log directory.

A line is ``{"global_step": g, "trained": [...], "pending": [...]}`` over all trainer ranks:
the ``id`` field of the rows behind the step's batch, and of the rows taken from the dataloader
whose trajectories were not trained yet (in flight when a checkpoint is written after the step;
a resumed run trains them first). Rows without an ``id`` field appear as null.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tandemrl.utils.files import append_text

PROMPT_LOG_FILE = "prompt_ids.jsonl"


def row_ids(rows: Sequence[dict[str, Any]]) -> list[Any]:
    return [row.get("id") for row in rows]


def _gather(ids: list[Any]) -> list[Any]:
    """Every rank's ids, rank 0's first (a collective when distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ids
    gathered: list[list[Any]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, ids)
    return [i for part in gathered for i in part]


def log_prompt_ids(
    log_dir: str, global_step: int, trained: Sequence[dict[str, Any]], pending: Sequence[dict[str, Any]]
) -> None:
    """Collective: append the step's line (written by rank 0)."""
    line = {"global_step": global_step, "trained": _gather(row_ids(trained)), "pending": _gather(row_ids(pending))}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(log_dir, exist_ok=True)
    append_text(os.path.join(log_dir, PROMPT_LOG_FILE), json.dumps(line) + "\n")


def read_prompt_log(log_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(log_dir, PROMPT_LOG_FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]
