"""Finished episodes into training batches: the data half of ``WorkflowExecutor``.

The executor (``tandemrl.rollout.executor``) queues rows, gates them by capacity and staleness and runs
episodes on its event loop; what an episode returns is handled here. ``check_trajectory`` refuses a
trajectory that is not a padded batch; an accepted one waits as an ``Accepted`` record (its weight
version, acceptance and submission order, source row, held scalars); ``split_batch`` orders the waiting
ones for hand-out (oldest weight version first, or submission order in deterministic mode) and
``must_wait_for_older`` says when a batch must be held back so an older running rollout is consumed in
time; ``record_hand_out`` books a batch in the ledger and the ``staleness`` stat, and ``collate`` pads and
concatenates it into the one ``TensorDict`` the trainer receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import RolloutWorkflow
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.rollout.ledger import Ledger, Tally, tally_of, total
from tandemrl.utils import stats_tracker


@dataclass
class Accepted:
    """An accepted trajectory."""

    traj: TensorDict
    version: int  # weight version when the rollout started
    seq: int  # acceptance order
    order: int  # submission order
    data: dict[str, Any]  # the row it was generated from
    held: stats_tracker.HeldScalars  # the episode's scalars, recorded when the trainer consumes it


def check_trajectory(traj: Any, workflow: RolloutWorkflow) -> None:
    mask = traj.get("attention_mask") if isinstance(traj, dict) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise TypeError(
            f"{type(workflow).__name__}.arun_episode returned {type(traj).__name__} without a 2-D 'attention_mask' "
            "tensor; expected a dict of padded tensors [n, L] or None"
        )


def split_batch(accepted: list[Accepted], count: int, deterministic: bool) -> tuple[list[Accepted], list[Accepted]]:
    """(the next ``count`` to hand out, the rest): the earliest submitted in deterministic mode, else the
    oldest weight version first (acceptance order within a version)."""
    if deterministic:
        ready = sorted(accepted, key=lambda d: d.order)
    else:
        ready = sorted(accepted, key=lambda d: (d.version, d.seq))
    return ready[:count], ready[count:]


def must_wait_for_older(
    rest: list[Accepted], running: list[int], count: int, version: int, max_head_offpolicyness: int
) -> bool:
    """Would handing out this batch leave an older rollout unable to be consumed in time?

    ``rest``: the accepted trajectories left after the batch; ``running``: the start versions of the
    untagged rollouts still running; ``k`` below: ``max_head_offpolicyness``.
    A rollout started at version v must be consumed by trainer version v + k. After this
    batch, the trainer (at ``version``) consumes ``count`` per step, so for every deadline
    d the leftovers due by d must fit in ``(d - version) * count`` slots. Only deadlines
    before version + k are at risk (later ones are covered by the capacity formula), and
    waiting only helps if a rollout due in that window is still running.
    """
    k = max_head_offpolicyness
    horizon = version + max(k, 1) - 1
    running_due = [v + k for v in running]
    if not any(d <= horizon for d in running_due):
        return False
    deadlines = sorted(
        [d.version + k for d in rest if d.version + k <= horizon] + [d for d in running_due if d <= horizon]
    )
    for i, d in enumerate(deadlines):
        last_of_value = i + 1 == len(deadlines) or deadlines[i + 1] != d
        if last_of_value and i + 1 > (max(d, version) - version) * count:
            return True
    return False


def samples_of(results: list[Accepted]) -> Tally:
    """Samples and tokens of ``results``, measured from their trajectories."""
    return total([tally_of(d.traj) for d in results])


def record_hand_out(results: list[Accepted], version: int, ledger: Ledger, stats_name: str) -> None:
    """Ledger and ``staleness`` (avg/min/max versions behind the trainer) of trajectories handed out,
    the same in sync (``rollout_batch``) and async (``prepare_batch``) runs."""
    ledger.consumed(samples_of(results))
    tracker = stats_tracker.get(stats_name)
    lags = torch.tensor([float(version - d.version) for d in results])
    tracker.denominator(n_consumed=torch.ones_like(lags, dtype=torch.bool))
    tracker.stat(staleness=lags, denominator="n_consumed")


def collate(results: list[Accepted]) -> TensorDict:
    """The trajectories of ``results`` padded to one length and concatenated, in this order."""
    return concat_padded_tensors([d.traj for d in results])
