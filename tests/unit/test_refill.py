"""A synchronous step's replacement rows across a restart (tandemrl/trainers/refill.py): the rows a refill read
from the dataloader but did not hand out are saved with the checkpoint's pending rows and come first after it."""

from __future__ import annotations

import itertools
from typing import Any

from tandemrl.trainers.refill import RefillRows, RunRows


def _batches(start: int = 0, size: int = 4) -> Any:
    """The dataloader's batches of rows {"id": n}, from row ``start`` on (a restored position)."""
    for first in itertools.count(start, size):
        yield [{"id": i} for i in range(first, first + size)]


class _Rollout:
    """The rollout's side of a RowSource: its own pending rows and ledger (what RolloutController gives)."""

    def __init__(self) -> None:
        self.ledger: dict[str, Any] = {}

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [{"id": -1}], {"generated": 3}

    def restore_ledger(self, state: dict[str, Any]) -> Any:
        self.ledger = state
        return "restored"


def test_a_restart_neither_skips_nor_repeats_a_replacement_row() -> None:
    uninterrupted = RefillRows(_batches())
    expected = [next(uninterrupted)["id"] for _ in range(11)]
    assert expected == list(range(11))
    # The run stops after 6 replacements: the refill has read 2 batches (rows 0-7) and handed out 0-5.
    run = RunRows(_Rollout())
    run.refill = RefillRows(_batches())
    got = [next(run.refill)["id"] for _ in range(6)]
    rows, ledger = run.recover_state()
    assert [r["id"] for r in rows] == [-1, 6, 7] and ledger == {"generated": 3}  # the rollout's rows, then the refill's
    # Resumed: the dataloader is past row 7; the checkpoint's rows come back through replay_first.
    resumed = RunRows(_Rollout())
    resumed.replay_first(rows[1:])
    assert resumed.restore_ledger({"generated": 3}) == "restored" and resumed.rollout.ledger == {"generated": 3}
    refill = RefillRows(_batches(start=8), resumed.replayed)
    got += [next(refill)["id"] for _ in range(5)]
    assert got == expected
    # Without the buffered rows (before: a generator over the same batches kept them in its frame) 6 and 7 were lost.
    assert [next(RefillRows(_batches(start=8)))["id"]] == [8]
