"""Which rows go in next: the first room of ``WorkflowExecutor`` (``tandemrl.rollout.executor``).

:class:`Feed` hands ``prepare_batch`` its rows: rows to replay first (a resumed run's pending
rows), else the dataloader's next batch, the dataloader re-iterated endlessly. It says when the
next batch is due (:meth:`Feed.refill_due`), from the version, the staleness bound and the queue
length it is given (it calls nothing back), and it remembers the rows taken that no batch has
handed out yet (:meth:`Feed.pending_rows`), which a recoverable checkpoint saves.

Deterministic mode's schedule: at weight version v (counted from the run's base version) the feed
has taken v + k + 1 batches, k = ``max_head_offpolicyness``.

A ``Feed`` has no lock of its own: the executor calls it under its episodes' condition, except
:meth:`Feed.pull`, which reads the dataloader on the trainer thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from tandemrl.data.loader import cycle_batches


class Feed:
    """Rows for ``prepare_batch``: replayed rows first, then the dataloader's batches, cycled."""

    def __init__(self) -> None:
        self.pulls = 0  # batches taken (from replay or the dataloader): the rollout index
        self._data_iter: Iterator[Any] | None = None
        self._data_source: Any = None
        self._pending: dict[int, dict[str, Any]] = {}  # order -> row taken, not handed out in a batch
        self._replay: deque[dict[str, Any]] = deque()  # rows to hand out before new dataloader rows

    def use(self, dataloader: Any) -> None:
        """Read ``dataloader`` from now on (a new one starts a fresh cycle; the same one goes on)."""
        if self._data_iter is None or self._data_source is not dataloader:
            self._data_iter, self._data_source = cycle_batches(dataloader), dataloader

    def refill_due(
        self, batch_size: int, queued: int, queue_size: int, deterministic: bool, version: int, bound: int
    ) -> bool:
        """Whether the next batch of rows goes in now: while fewer than a batch are ``queued`` (and a
        batch fits the queue), or in deterministic mode while fewer than ``version + bound + 1`` batches
        were taken (``version`` counted from the run's base version)."""
        if deterministic:
            return self.pulls < version + bound + 1
        return queued < batch_size and queue_size - queued >= batch_size

    def replayed(self, batch_size: int) -> list[dict[str, Any]]:
        """Up to ``batch_size`` rows to replay (see :meth:`replay_first`); [] when none are left."""
        return [self._replay.popleft() for _ in range(min(batch_size, len(self._replay)))]

    def pull(self) -> list[dict[str, Any]]:
        """The dataloader's next batch (a failed read starts a fresh pass at the next call)."""
        assert self._data_iter is not None, "Feed.use(dataloader) first"
        try:
            rows = next(self._data_iter)
        except Exception:
            self._data_iter = None
            raise
        if not isinstance(rows, list | tuple):
            raise TypeError(
                f"prepare_batch: the dataloader must yield lists of rows (collate_fn=collate_as_list), "
                f"got {type(rows).__name__}"
            )
        return list(rows)

    def taken(self, order: int, row: dict[str, Any]) -> None:
        """Row ``row`` went in as submission ``order``; it is pending until :meth:`consumed`."""
        self._pending[order] = row

    def consumed(self, order: int) -> None:
        """Submission ``order`` was handed out in a batch or rejected (a rejected row counts as consumed)."""
        self._pending.pop(order, None)

    def pending_rows(self) -> list[dict[str, Any]]:
        """Rows taken whose trajectories no batch has handed out yet, oldest first, then the rows still to replay."""
        return [self._pending[o] for o in sorted(self._pending)] + list(self._replay)

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None:
        """Hand out ``rows`` (e.g. a checkpoint's :meth:`pending_rows`) before new dataloader rows."""
        self._replay.extend(rows)
