"""Per-request sampling seeds of deterministic mode, and the rollout key they are derived from.

A seed depends only on where a sample sits in the run, never on timing or request order:
the run's seed, the rollout the row was submitted with (the executor's dataloader batch in
asynchronous RL, its ``rollout_batch`` call in synchronous RL), the row's ``id`` (its index in
the dataset), the resubmission of that row within the rollout (``attempt``), and the sample
(and turn) within the row's group. The executor sets the key of each episode it starts
(:func:`rollout_key_context`); workflows read it with :func:`current_rollout_key`.
"""

from __future__ import annotations

import contextvars
import hashlib
from dataclasses import dataclass
from typing import Any

# vLLM and SGLang take any non-negative int; 31 bits fit every server's and torch's seed type.
SEED_BITS = 31


@dataclass(frozen=True)
class RolloutKey:
    """Where an episode sits in the run: its rollout and the resubmission of its row within it."""

    rollout: int
    attempt: int = 0


_KEY: contextvars.ContextVar[RolloutKey | None] = contextvars.ContextVar("tandemrl_rollout_key", default=None)


def current_rollout_key() -> RolloutKey | None:
    """The key of the episode running in this asyncio task (None outside an executor's episode)."""
    return _KEY.get()


def rollout_key_context(key: RolloutKey) -> contextvars.Context:
    """A copy of the current context with ``key`` set: run an episode's task in it."""
    ctx = contextvars.copy_context()
    ctx.run(_KEY.set, key)
    return ctx


def sample_seed(seed: int, *parts: int) -> int:
    """A seed in ``[0, 2**31)`` from the run's ``seed`` and integer ``parts`` (a hash, stable across runs)."""
    text = ":".join(str(int(p)) for p in (seed, *parts))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << SEED_BITS)


def request_seed(seed: int | None, row: dict[str, Any], sample: int, turn: int = 0) -> int | None:
    """The sampling seed of sample ``sample`` (turn ``turn``) of ``row`` in the running episode.

    None when ``seed`` is None (deterministic mode off). The row must carry its dataset index
    as ``id`` and the episode must run under an executor's rollout key.
    """
    if seed is None:
        return None
    key = current_rollout_key()
    if key is None:
        raise RuntimeError("deterministic sampling seeds need the episode to run under a WorkflowExecutor")
    prompt = row.get("id")
    if isinstance(prompt, bool) or not isinstance(prompt, int):
        raise ValueError(
            f"deterministic: row field 'id' must be the row's integer index in the dataset, got {prompt!r:.40} "
            f"(fields: {sorted(row)})"
        )
    return sample_seed(seed, key.rollout, prompt, key.attempt, sample, turn)
