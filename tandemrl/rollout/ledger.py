"""The sample and token ledger: where every generated sample went (docs/ledger.md).

At every moment, for samples (trajectory rows) and for tokens (their generated tokens, the
``loss_mask`` ones) alike::

    generated = consumed + sum(discarded[reason] for reason in REASONS) + in_flight

* **generated**: a sample whose generation finished and that came back from its workflow,
  in a returned batch or noted by the workflow before it dropped the group or failed
  (``tandemrl.api.episode.note_generated``);
* **consumed**: handed to the trainer in a batch (and not masked out of the loss, see ``too_long``);
* **discarded**, by reason (:data:`REASONS`);
* **in flight**: generated, accepted and waiting for a batch. It is measured from the waiting
  trajectories themselves when the ledger is read, not counted, so a sample that leaves the
  queue without a ledger entry breaks the balance.

Episodes still queued or running have generated nothing the ledger can count yet (their tokens
are unknown until they finish): they are reported as ``running_episodes`` and stay outside the
balance. The executor counts generation, consumption and its own discards; the trainer's loop
moves the consumed samples the update masks out to ``too_long``; a restored checkpoint's
samples in flight become ``lost_at_restart`` (their prompts are generated again).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

REASONS = (
    "filtered",  # should_accept_fn (dynamic sampling) rejected the group
    "group_dropped",  # the workflow returned None after generating (e.g. a reward failed)
    "failed",  # the workflow raised after generating (workflow_error_policy=drop)
    "abandoned",  # finished after its rollout_batch call had given up
    "too_long",  # handed to the trainer but masked out of the loss for not ending with EOS (mask_no_eos)
    "lost_at_restart",  # waiting for a batch when the checkpoint a run resumed from was written
)


class LedgerError(RuntimeError):
    """The ledger does not balance: some samples were lost or counted twice."""


@dataclass(frozen=True)
class Tally:
    """A number of samples and of their generated tokens."""

    samples: int = 0
    tokens: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.samples + other.samples, self.tokens + other.tokens)

    def __sub__(self, other: Tally) -> Tally:
        return Tally(self.samples - other.samples, self.tokens - other.tokens)


def tally_of(traj: Mapping[str, torch.Tensor]) -> Tally:
    """A trajectory batch's rows and generated tokens (``loss_mask``; ``attention_mask`` without one)."""
    mask = traj.get("loss_mask")
    if mask is None:
        mask = traj["attention_mask"]
    return Tally(int(traj["attention_mask"].shape[0]), int(mask.sum()))


def total(tallies: Sequence[Tally]) -> Tally:
    return sum(tallies, Tally())


@dataclass(frozen=True)
class LedgerTotals:
    """A consistent reading of a ledger (or the sum of several ranks' readings)."""

    generated: Tally = Tally()
    consumed: Tally = Tally()
    discarded: dict[str, Tally] = field(default_factory=dict)
    in_flight: Tally = Tally()
    running_episodes: int = 0
    groups: int = 0  # episodes (one group each) that finished, trained or not
    groups_dropped: int = 0  # of those, the ones whose workflow failed or returned None (the failure budget's count)

    def discarded_total(self) -> Tally:
        return total(list(self.discarded.values()))

    def check(self) -> None:
        """Raise :class:`LedgerError` (one line) unless generated = consumed + discarded + in flight."""
        out = self.consumed + self.discarded_total() + self.in_flight
        for unit in ("samples", "tokens"):
            gen, acc = getattr(self.generated, unit), getattr(out, unit)
            if gen != acc:
                what = f"{gen - acc} {unit} unaccounted for" if gen > acc else f"{acc - gen} {unit} counted twice"
                raise LedgerError(
                    f"sample ledger violated: {what}: generated {gen} != consumed {getattr(self.consumed, unit)} "
                    f"+ discarded {getattr(self.discarded_total(), unit)} + in flight {getattr(self.in_flight, unit)}"
                )

    def to_vector(self) -> list[float]:
        """Fixed-order numbers (sum them over ranks, then :meth:`from_vector`)."""
        tallies = [self.generated, self.consumed, *(self.discarded.get(r, Tally()) for r in REASONS), self.in_flight]
        counts = [self.running_episodes, self.groups, self.groups_dropped]
        return [float(x) for t in tallies for x in (t.samples, t.tokens)] + [float(c) for c in counts]

    @classmethod
    def from_vector(cls, values: Sequence[float]) -> LedgerTotals:
        ints = [round(v) for v in values]
        pairs = [Tally(ints[i], ints[i + 1]) for i in range(0, len(ints) - 3, 2)]
        running, groups, dropped = ints[-3:]
        return cls(
            pairs[0], pairs[1], dict(zip(REASONS, pairs[2:-1], strict=True)), pairs[-1], running, groups, dropped
        )

    def stats(self) -> dict[str, float]:
        """Run totals as ``ledger/...`` scalars (samples and tokens of each term, each discard reason)."""
        out: dict[str, float] = {
            "ledger/running_episodes": float(self.running_episodes),
            "ledger/groups": float(self.groups),
            "ledger/groups_dropped": float(self.groups_dropped),
        }
        named = {"generated": self.generated, "consumed": self.consumed, "in_flight": self.in_flight}
        named.update({f"discarded/{r}": self.discarded.get(r, Tally()) for r in REASONS})
        for name, t in named.items():
            out[f"ledger/{name}_samples"] = float(t.samples)
            out[f"ledger/{name}_tokens"] = float(t.tokens)
        return out

    def line(self) -> str:
        """One line: the balance in samples (tokens in parentheses) and every non-zero discard reason."""

        def fmt(t: Tally) -> str:
            return f"{t.samples} ({t.tokens} tokens)"

        reasons = ", ".join(f"{r} {fmt(t)}" for r in REASONS if (t := self.discarded.get(r, Tally())).samples)
        return (
            f"ledger: generated {fmt(self.generated)} = consumed {fmt(self.consumed)} + discarded "
            f"{fmt(self.discarded_total())}{f' [{reasons}]' if reasons else ''} + in flight {fmt(self.in_flight)} "
            f"samples; {self.running_episodes} episodes still running; groups: {self.groups_dropped} of "
            f"{self.groups} dropped (a reward or workflow failed)"
        )


class Ledger:
    """Thread-safe counters of generated, consumed and discarded samples and tokens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generated = Tally()
        self._consumed = Tally()
        self._discarded: dict[str, Tally] = {}
        self._groups = 0
        self._groups_dropped = 0

    def episode(self, dropped: bool) -> None:
        """One episode (one group) finished; ``dropped``: its workflow failed or returned None."""
        with self._lock:
            self._groups += 1
            self._groups_dropped += int(dropped)

    def generated(self, t: Tally) -> None:
        with self._lock:
            self._generated += t

    def consumed(self, t: Tally) -> None:
        with self._lock:
            self._consumed += t

    def discarded(self, reason: str, t: Tally) -> None:
        _check_reason(reason)
        with self._lock:
            self._discarded[reason] = self._discarded.get(reason, Tally()) + t

    def unconsume(self, reason: str, t: Tally) -> None:
        """Samples counted as consumed that the update does not train on after all (e.g. ``too_long``)."""
        _check_reason(reason)
        with self._lock:
            self._consumed -= t
            self._discarded[reason] = self._discarded.get(reason, Tally()) + t

    def totals(self, in_flight: Tally, running_episodes: int = 0) -> LedgerTotals:
        """The counters with ``in_flight`` (measured by the caller at the same moment)."""
        with self._lock:
            return LedgerTotals(
                self._generated,
                self._consumed,
                dict(self._discarded),
                in_flight,
                running_episodes,
                self._groups,
                self._groups_dropped,
            )

    def state_dict(self, in_flight: Tally) -> dict[str, Any]:
        """JSON-able counters plus the samples in flight at this moment (lost if the run restarts from here)."""
        with self._lock:
            return {
                "generated": _pair(self._generated),
                "consumed": _pair(self._consumed),
                "discarded": {r: _pair(t) for r, t in self._discarded.items()},
                "in_flight": _pair(in_flight),
                "groups": [self._groups, self._groups_dropped],
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> Tally:
        """Restore the counters; the saved in-flight samples become ``lost_at_restart``, which is returned."""
        if not isinstance(state, Mapping):
            raise ValueError(f"ledger state must be a mapping, got {type(state).__name__}")
        missing = [k for k in ("generated", "consumed", "discarded", "in_flight") if k not in state]
        if missing:
            raise ValueError(f"ledger state lacks {missing}")
        discarded = state["discarded"]
        if not isinstance(discarded, Mapping):
            raise ValueError(f"ledger state field 'discarded' must map reasons to [samples, tokens], got {discarded!r}")
        for reason in discarded:
            _check_reason(reason)
        lost = _tally(state["in_flight"], "in_flight")
        groups = _ints(state.get("groups", [0, 0]), "groups", "[finished, dropped]")  # absent in older checkpoints
        with self._lock:
            self._generated = _tally(state["generated"], "generated")
            self._consumed = _tally(state["consumed"], "consumed")
            self._discarded = {r: _tally(v, f"discarded.{r}") for r, v in discarded.items()}
            self._discarded["lost_at_restart"] = self._discarded.get("lost_at_restart", Tally()) + lost
            self._groups, self._groups_dropped = groups
        return lost


def _check_reason(reason: str) -> None:
    if reason not in REASONS:
        raise ValueError(f"ledger: unknown discard reason {reason!r}; one of {', '.join(REASONS)}")


def _pair(t: Tally) -> list[int]:
    return [t.samples, t.tokens]


def _ints(value: Any, name: str, shape: str) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"ledger state field '{name}' must be {shape} integers, got {value!r}")
    return int(value[0]), int(value[1])


def _tally(value: Any, name: str) -> Tally:
    return Tally(*_ints(value, name, "[samples, tokens]"))
