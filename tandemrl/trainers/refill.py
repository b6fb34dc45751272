"""The rows a synchronous step draws to replace rejected groups, kept across a restart.

With dynamic sampling (``should_accept_fn``) a synchronous step replaces each rejected group by the next
dataloader row (:class:`RefillRows`): it reads a whole batch and uses as many rows as it needs, so the rest
of that batch waits in its buffer for the next replacement. Those rows were taken from the dataloader (its
saved position is past them) but never trained: :class:`RunRows` adds them to the pending rows a
recoverable checkpoint saves, and gives them back to the refill when the run resumes, so a restart neither
skips nor repeats a row (the asynchronous path keeps its own, ``rollout.feed``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from tandemrl.trainers.recover import RowSource


class RefillRows(Iterator[dict[str, Any]]):
    """Row after row of ``batches`` (the dataloader's), after the ``first`` rows a checkpoint gave back."""

    def __init__(self, batches: Iterator[list[dict[str, Any]]], first: Iterable[dict[str, Any]] = ()) -> None:
        self._batches = batches
        self._buffer: deque[dict[str, Any]] = deque(first)

    def __next__(self) -> dict[str, Any]:
        while not self._buffer:
            self._buffer.extend(next(self._batches))
        return self._buffer.popleft()

    def buffered(self) -> list[dict[str, Any]]:
        """Rows read from the dataloader and not handed out yet, in order."""
        return list(self._buffer)


class RunRows:
    """The run's :class:`~tandemrl.trainers.recover.RowSource`: the rollout's pending rows plus the refill's
    buffered ones when saving; when resuming, what the checkpoint gives back is kept in :attr:`replayed` for the
    trainer to hand to the refill (synchronous) or the rollout (asynchronous) once it knows which it runs."""

    def __init__(self, rollout: RowSource) -> None:
        self.rollout = rollout
        self.refill: RefillRows | None = None
        self.replayed: list[dict[str, Any]] = []

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rows, ledger = self.rollout.recover_state()
        return rows + (self.refill.buffered() if self.refill is not None else []), ledger

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None:
        self.replayed.extend(rows)

    def restore_ledger(self, state: dict[str, Any]) -> Any:
        return self.rollout.restore_ledger(state)
