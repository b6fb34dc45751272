"""What a running episode tells the rollout executor, beyond the batch it returns.

The executor gives each episode fresh :class:`EpisodeNotes` (:func:`notes_in`) and reads them when the
episode ends. Code inside the episode (a workflow, the reward runner, an agent) writes to them with the
functions below; outside an executor's episode each call does nothing.

* :func:`note_generated`: samples that finished generating (their tokens came back from the engine),
  before they are scored or filtered. When the episode returns a batch, the sample ledger
  (``tandemrl.rollout.ledger``) counts that batch and ignores the note; when it returns None (the
  workflow dropped the group, e.g. a reward failed) or raises, the noted samples are counted as
  discarded (``group_dropped``, ``failed``), so samples a workflow throws away never vanish.
* :func:`waiting` / :func:`note_waited`: time spent waiting on the environment (a tool's HTTP call, a
  reward function, a judge); logged per episode as ``<stats_name>/env_wait``. The reward runner and the
  agent workflow do it for their calls.
* :func:`note_failure`: why the episode is about to drop its group (a reward that raised, timed out...);
  the executor's failure budget (``rollout.max_consecutive_drops``, ``rollout.max_dropped_share``) names the
  most common cause when it stops the run.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class EpisodeNotes:
    """What one episode noted: finished samples and their tokens, environment wait, failures (kind, detail)."""

    samples: int = 0
    tokens: int = 0
    wait_seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)


_NOTES: contextvars.ContextVar[EpisodeNotes | None] = contextvars.ContextVar("tandemrl_episode_notes", default=None)
_now = time.perf_counter  # the clock of waiting()


def notes_in(ctx: contextvars.Context) -> EpisodeNotes:
    """Give the episode that will run in ``ctx`` fresh notes and return them (read when the episode ends)."""
    notes = EpisodeNotes()
    ctx.run(_NOTES.set, notes)
    return notes


def current_notes() -> EpisodeNotes | None:
    """The notes of the episode running in this context; None outside one."""
    return _NOTES.get()


def note_generated(samples: int, tokens: int) -> None:
    """Record that ``samples`` samples with ``tokens`` generated tokens in all finished generating."""
    for name, value in (("samples", samples), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"note_generated: {name} must be an integer >= 0, got {value!r}")
    notes = _NOTES.get()
    if notes is not None:
        notes.samples += samples
        notes.tokens += tokens


def note_waited(seconds: float) -> None:
    """Add ``seconds`` of environment wait to the current episode. Calls that overlap (a group's rewards
    scored at once) each add their own time."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise ValueError(f"note_waited: seconds must be a number >= 0, got {seconds!r}")
    notes = _NOTES.get()
    if notes is not None:
        notes.wait_seconds += float(seconds)


@contextmanager
def waiting() -> Iterator[None]:
    """``with waiting(): result = await tool(...)``: the block's wall time counts as environment wait."""
    start = _now()
    try:
        yield
    finally:
        note_waited(_now() - start)


def note_failure(kind: str, detail: str) -> None:
    """Record a failure that makes the episode drop its group: ``kind`` groups alike failures ("raised
    ValueError", "timeout"), ``detail`` is one line for the user."""
    notes = _NOTES.get()
    if notes is not None:
        notes.failures.append((str(kind), " ".join(str(detail).split())[:300]))
