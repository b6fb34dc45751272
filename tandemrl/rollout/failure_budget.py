"""How many failed episodes a run tolerates before it stops, and the one line that says why it stopped.

An episode *drops* its group when its workflow returns None (a reward that raised, timed out or returned
junk; a reward service that gave up; an agent that timed out) or raises under
``workflow_error_policy='drop'``. Groups filtered out on purpose (``should_accept_fn``, DAPO's dynamic
sampling) are not failures. Without a bound, a reward that always fails would make the run generate and
throw away forever. :class:`FailureBudget` stops it when ``max_consecutive`` groups in a row dropped, or
when more than ``max_share`` of the last ``window`` finished groups dropped, naming the most common
cause with its first detail (what ``tandemrl.api.episode.note_failure`` recorded).
"""

from __future__ import annotations

from collections import Counter, deque


class FailureBudgetExceeded(RuntimeError):
    """Too many episodes dropped their groups; the message is one line with the counts and the cause."""


class FailureBudget:
    """``record`` each finished episode; it returns the one-line reason once the budget is spent."""

    def __init__(self, max_consecutive: int, max_share: float, window: int) -> None:
        if max_consecutive < 0 or not 0.0 <= max_share <= 1.0 or window < 1:
            raise ValueError(
                f"failure budget: need max_consecutive_drops >= 0, 0 <= max_dropped_share <= 1, drop_window >= 1; "
                f"got {max_consecutive}, {max_share}, {window}"
            )
        self.max_consecutive, self.max_share, self.window = max_consecutive, max_share, window
        self._recent: deque[bool] = deque(maxlen=window)
        self._consecutive = 0
        self._kinds: Counter[str] = Counter()
        self._first: dict[str, str] = {}
        self.dropped = 0
        self.finished = 0

    def record(self, dropped: bool, causes: list[tuple[str, str]]) -> str | None:
        """One finished episode (``dropped``: its group was dropped; ``causes``: (kind, detail) it noted)."""
        self.finished += 1
        self._recent.append(dropped)
        if not dropped:
            self._consecutive = 0
            return None
        self.dropped += 1
        self._consecutive += 1
        for kind, detail in causes or [("workflow returned None", "the workflow noted no cause")]:
            self._kinds[kind] += 1
            self._first.setdefault(kind, detail)
        share = sum(self._recent) / len(self._recent)
        if self.max_consecutive and self._consecutive >= self.max_consecutive:
            what = f"{self._consecutive} groups in a row were dropped (rollout.max_consecutive_drops={self.max_consecutive})"
        elif len(self._recent) == self.window and share > self.max_share:
            what = (
                f"{sum(self._recent)} of the last {self.window} groups were dropped "
                f"(rollout.max_dropped_share={self.max_share:g})"
            )
        else:
            return None
        return f"rollout failure budget spent: {what}; {self.main_cause()}"

    def main_cause(self) -> str:
        """``N of M groups dropped so far, most often <kind> (K times), first: <detail>``; "" before any drop."""
        if not self.dropped:
            return ""
        kind, count = self._kinds.most_common(1)[0]
        return (
            f"{self.dropped} of {self.finished} groups dropped so far, most often {kind} ({count} times), "
            f"first: {self._first[kind]}"
        )
