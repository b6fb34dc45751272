"""How long a client kept its servers busy: seconds with at least one generate request in flight.

The rollout controller reads it once per step (``take``) to report the servers' idle share of the
step (``rollout/timeperf/server_busy`` and the closing time-split line). Requests run on the HTTP
client's event loop, the reader is the trainer thread: a lock guards the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class BusyClock:
    """Union of the intervals during which ``running()`` blocks are open, read and reset by ``take()``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0  # when the current busy interval (or the unread part of it) began
        self._busy = 0.0  # closed busy time not yet taken

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count the block as busy time (overlapping blocks count once)."""
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy += self._clock() - self._since

    def take(self) -> float:
        """Busy seconds since the last ``take`` (an open interval counts up to now), then reset."""
        with self._lock:
            now = self._clock()
            busy = self._busy
            if self._in_flight > 0:
                busy += now - self._since
                self._since = now
            self._busy = 0.0
            return busy
