"""Episodes that are one whole group, or none: what group normalisation (GRPO's ``actor.group_size``) needs.

A workflow whose episodes return a varying number of rows (an agent run whose history did not stitch into
one trajectory, ``granularity='turn'``, a custom workflow) would otherwise reach the trainer as a batch
that is not a whole number of groups, and stop the run in the advantage normalisation. :class:`WholeGroups`
wraps the workflow when the trainer asks for batches in groups of ``rows``: an episode with any other number
of rows drops its group, with its cause noted (``tandemrl.api.episode.note_failure``), so it is counted as a
dropped group in the ledger's closing line and spends the run's failure budget
(``rollout.max_consecutive_drops``, ``rollout.max_dropped_share``) instead of ending the run.
"""

from __future__ import annotations

from typing import Any

import torch

from tandemrl.api.episode import current_notes, note_failure, note_generated
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow

WRONG_ROWS = "episode not one group"  # the failure kind


class WholeGroups(RolloutWorkflow):
    """``workflow``'s episodes, each exactly ``rows`` rows; any other count drops the group (see module)."""

    def __init__(self, workflow: RolloutWorkflow, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"WholeGroups: rows must be >= 1, got {rows}")
        self.workflow, self.rows = workflow, rows

    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        traj = await self.workflow.arun_episode(client, data)
        mask = traj.get("attention_mask") if isinstance(traj, dict) else None
        if traj is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] == self.rows:
            return traj  # None, a whole group, or a malformed result the executor names
        notes = current_notes()
        if notes is not None and notes.samples == 0:  # what it generated still enters the ledger
            loss_mask = traj.get("loss_mask", mask)
            note_generated(int(mask.shape[0]), int(loss_mask.sum()))
        note_failure(
            WRONG_ROWS,
            f"{type(self.workflow).__name__} returned {mask.shape[0]} rows for one prompt; the trainer's groups "
            f"need {self.rows} (actor.group_size)",
        )
        return None


def workflow_name(workflow: RolloutWorkflow) -> str:
    """The class name a message should show: the wrapped workflow's for a :class:`WholeGroups`."""
    return type(workflow.workflow if isinstance(workflow, WholeGroups) else workflow).__name__
