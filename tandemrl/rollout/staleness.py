"""How many new rollouts may start now, bounding concurrency and off-policyness.

With consumer batch size B and max staleness k, at weight version v at most
``(k + v + 1) * B`` non-rejected rollouts may ever have been started. Rollouts are
started in version order, so the ones started at versions <= v number at most
``(v + k + 1) * B``: the trainer, consuming B per version, can consume every one of them
by version v + k (the executor's ``wait`` picks them oldest-first to make sure it does).
Rejected rollouts give their slot back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class RolloutStat:
    """Counts of rollouts so far: every submitted one is running, accepted or rejected."""

    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    running: int = 0


class StalenessManager:
    """Thread-safe bookkeeping of rollout counts and the capacity formula."""

    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_head_offpolicyness: int) -> None:
        for name, value, low in (
            ("max_concurrent_rollouts", max_concurrent_rollouts, 1),
            ("consumer_batch_size", consumer_batch_size, 1),
            ("max_head_offpolicyness", max_head_offpolicyness, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"StalenessManager: {name} must be an integer >= {low}, got {value!r}")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_head_offpolicyness = max_head_offpolicyness
        self._lock = threading.Lock()
        self._stat = RolloutStat()
        self._base_version = 0  # version the counts start from (a resumed run starts above 0)

    def get_capacity(self, current_version: int) -> int:
        """Rollouts that may start now (may be negative: then none may start).

        ``min(max_concurrent - running, (k + v + 1) * B - (accepted + running))``.
        """
        with self._lock:
            s = self._stat
            concurrency = self.max_concurrent_rollouts - s.running
            versions = self.max_head_offpolicyness + current_version - self._base_version + 1
            staleness = versions * self.consumer_batch_size - (s.accepted + s.running)
            return min(concurrency, staleness)

    @property
    def base_version(self) -> int:
        """The version the counts start from (see :meth:`set_base_version`)."""
        return self._base_version

    def set_base_version(self, version: int) -> None:
        """Count from ``version``: a run resumed there consumed every batch of earlier versions.

        Without it a fresh manager at version v would grant ``v * B`` extra rollouts that the
        trainer only consumes up to v versions later, breaking the staleness bound.
        """
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"StalenessManager.set_base_version: version must be an integer >= 0, got {version!r}")
        with self._lock:
            self._base_version = version

    def on_submit(self) -> None:
        """A rollout started running."""
        with self._lock:
            self._stat.submitted += 1
            self._stat.running += 1

    def on_finish(self, accepted: bool) -> None:
        """A running rollout ended; only accepted ones keep their staleness slot."""
        with self._lock:
            if self._stat.running <= 0:
                raise RuntimeError("StalenessManager: a rollout finished but none was running")
            self._stat.running -= 1
            if accepted:
                self._stat.accepted += 1
            else:
                self._stat.rejected += 1

    def on_accept(self) -> None:
        self.on_finish(True)

    def on_reject(self) -> None:
        self.on_finish(False)

    def get_stats(self) -> RolloutStat:
        """A consistent snapshot of the counts."""
        with self._lock:
            s = self._stat
            return RolloutStat(s.submitted, s.accepted, s.rejected, s.running)
