"""What a running episode tells the executor's sample ledger (``tandemrl.rollout.ledger``).

A workflow calls :func:`note_generated` once samples have finished generating (their tokens
came back from the engine), before it scores or filters them. When the episode then returns a
batch, that batch is what the ledger counts (its rows and ``loss_mask`` tokens) and the note is
ignored; when it returns None (the workflow dropped the group, e.g. a reward failed) or raises,
the noted samples are counted as discarded (``group_dropped``, ``failed``), so samples a
workflow throws away never vanish from the ledger. Outside an executor's episode the call does
nothing. The executor gives each episode a fresh tally (:func:`tally_in`).
"""

from __future__ import annotations

import contextvars
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
