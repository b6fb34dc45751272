"""What a running episode tells the executor's sample ledger (``tandemrl.rollout.ledger``).

A workflow calls :func:`note_generated` once samples have finished generating (their tokens
came back from the engine), before it scores or filters them. When the episode then returns a
batch, that batch is what the ledger counts (its rows and ``loss_mask`` tokens) and the note is
ignored; when it returns None (the workflow dropped the group, e.g. a reward failed) or raises,
the noted samples are counted as discarded (``group_dropped``, ``failed``), so samples a
workflow throws away never vanish from the ledger. Outside an executor's episode the call does
nothing. The executor gives each episode a fresh tally (:func:`tally_in`).

The same way, code inside an episode reports time spent waiting on its environment (a tool's HTTP
call, a reward function, a judge) with :func:`waiting` or :func:`note_waited`; the reward runner and
the agent workflow do it for their calls. It is logged per episode as ``<stats_name>/env_wait``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class GeneratedTally:
    """Samples (and their generated tokens) an episode noted as finished."""

    samples: int = 0
    tokens: int = 0


_TALLY: contextvars.ContextVar[GeneratedTally | None] = contextvars.ContextVar("tandemrl_episode_tally", default=None)


def note_generated(samples: int, tokens: int) -> None:
    """Record that ``samples`` samples with ``tokens`` generated tokens in all finished generating."""
    for name, value in (("samples", samples), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"note_generated: {name} must be an integer >= 0, got {value!r}")
    tally = _TALLY.get()
    if tally is not None:
        tally.samples += samples
        tally.tokens += tokens


def tally_in(ctx: contextvars.Context) -> GeneratedTally:
    """Give the episode that will run in ``ctx`` a fresh tally and return it (read when the episode ends)."""
    tally = GeneratedTally()
    ctx.run(_TALLY.set, tally)
    return tally


@dataclass
class WaitClock:
    """Seconds an episode spent waiting on its environment: tools, reward functions, judges, sandboxes."""

    seconds: float = 0.0


_now = time.perf_counter  # the clock of waiting()
_WAIT: contextvars.ContextVar[WaitClock | None] = contextvars.ContextVar("tandemrl_episode_wait", default=None)


def start_wait_clock() -> WaitClock:
    """Give the episode running in the current context a fresh clock and return it (the executor reads it
    when the episode ends and records it as ``<stats_name>/env_wait``)."""
    clock = WaitClock()
    _WAIT.set(clock)
    return clock


def note_waited(seconds: float) -> None:
    """Add ``seconds`` of environment wait to the current episode (nothing outside an episode). Calls that
    overlap (a group's rewards scored at once) each add their own time."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise ValueError(f"note_waited: seconds must be a number >= 0, got {seconds!r}")
    clock = _WAIT.get()
    if clock is not None:
        clock.seconds += float(seconds)


@contextmanager
def waiting() -> Iterator[None]:
    """``with waiting(): result = await tool(...)``: the block's wall time counts as environment wait."""
    start = _now()
    try:
        yield
    finally:
        note_waited(_now() - start)
