"""Statistics recorded during training and rollout, reduced across ranks at export time.

Two ways to record:

* ``scalar(reward=0.5)``: one float per call (rollout workflows, learning rates, timings).
  Exported as the mean over every recorded value plus ``key__count`` so that callers can
  merge exports from several processes with count-weighted averages.
* ``denominator(n_tokens=mask)`` then ``stat(loss=tensor, denominator="n_tokens")``:
  batch tensors masked by a boolean denominator (per-token or per-sequence metrics).

Exports with a ``reduce_group`` are exact across ranks: averages are
``sum(value * mask) / sum(mask)`` over all ranks' elements, not averages of averages.
Each rank keeps running partial sums (sum, count, min, max) per key, so memory does not
grow with the number of recorded micro-batches.

A module-level default tracker backs the free functions; ``get(name)`` returns a named
tracker (e.g. ``"rollout"``) whose exported keys are prefixed with ``"<name>/"``.

Scalars recorded inside a context given a :class:`HeldScalars` (``hold_in``) are kept aside
until ``release()``: the rollout executor holds each episode's scalars until the trainer
consumes the episode, so a step's ``rollout/reward`` describes the samples that step trained
on, in sync and async runs alike.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "HeldScalars",
    "hold_in",
    "muted",
    "ReduceType",
    "StatsTracker",
    "denominator",
    "export",
    "export_all",
    "get",
    "record_timing",
    "scalar",
    "scope",
    "scope_func_wrapper",
    "stat",
]

F = TypeVar("F", bound=Callable[..., Any])


class ReduceType(enum.Enum):
    """How a recorded key is reduced at export."""

    AVG_MIN_MAX = "avg_min_max"  # key/avg, key/min, key/max
    AVG = "avg"  # masked mean
    SUM = "sum"  # masked sum
    MIN = "min"  # masked minimum
    MAX = "max"  # masked maximum
    SCALAR = "scalar"  # mean of samples, plus key__count


# Kinds of recorded keys; a key keeps one kind (and one reduce type) until reset.
_DENOM = "denominator"
_STAT = "stat"
_SCALAR = "scalar"


@dataclass
class _Partial:
    """Running local aggregate of one key: float64 sums plus masked min/max."""

    kind: str
    reduce_type: ReduceType
    total: float | torch.Tensor = 0.0  # tensors stay on the device they were recorded on
    count: float | torch.Tensor = 0.0
    vmin: float | torch.Tensor = float("inf")
    vmax: float | torch.Tensor = float("-inf")

    def copy(self) -> _Partial:
        return _Partial(self.kind, self.reduce_type, self.total, self.count, self.vmin, self.vmax)


_MUTE = threading.local()


def _is_muted() -> bool:
    return getattr(_MUTE, "depth", 0) > 0


@contextmanager
def muted() -> Iterator[None]:
    """Drop everything recorded in this thread inside the block (e.g. filler micro-batches)."""
    _MUTE.depth = getattr(_MUTE, "depth", 0) + 1
    try:
        yield
    finally:
        _MUTE.depth -= 1


class HeldScalars:
    """Scalars recorded in one context (an episode), added to their trackers at ``release()``."""

    def __init__(self) -> None:
        self._items: list[tuple[StatsTracker, str, float]] = []
        self._lock = threading.Lock()
        self.released = False

    def add(self, tracker: StatsTracker, full_key: str, value: float) -> None:
        with self._lock:
            if self.released:  # recorded after release (a straggling callback): record it directly
                tracker._add_scalar(full_key, value)
            else:
                self._items.append((tracker, full_key, value))

    def release(self, under: str = "") -> None:
        """Record every held scalar in its tracker (once; later calls do nothing); with ``under``, each key
        moves below that scope (``reward`` -> ``filtered/reward``)."""
        with self._lock:
            items, self._items, self.released = self._items, [], True
        for tracker, full_key, value in items:
            tracker._add_scalar(_join(under, full_key), value)

    def __len__(self) -> int:
        return len(self._items)


_HELD: contextvars.ContextVar[HeldScalars | None] = contextvars.ContextVar("tandemrl_held_scalars", default=None)


def hold_in(ctx: contextvars.Context) -> HeldScalars:
    """Hold the scalars recorded by code running in ``ctx`` (not threads it hands work to) until release."""
    held = HeldScalars()
    ctx.run(_HELD.set, held)
    return held


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class StatsTracker:
    """A namespace of recorded statistics; safe to record from several threads."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._lock = threading.RLock()
        self._local = threading.local()  # per-thread scope stack
        self._partials: dict[str, _Partial] = {}
        self._masks: dict[str, torch.Tensor] = {}  # last mask per denominator, for stat()

    # ------------------------------------------------------------------ scopes
    def _scopes(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _full_key(self, key: str) -> str:
        if not key:
            raise ValueError("stats_tracker: empty statistic name")
        return _join(*self._scopes(), key)

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside the block with ``name/`` (nests)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"stats_tracker.scope: name must be a non-empty string, got {name!r}")
        stack = self._scopes()
        stack.append(name.strip("/"))
        try:
            yield
        finally:
            stack.pop()

    def scope_func_wrapper(self, name: str) -> Callable[[F], F]:
        """Decorator running the whole function inside ``scope(name)``."""

        def decorator(fn: F) -> F:
            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                    with self.scope(name):
                        return await fn(*args, **kwargs)

                return async_wrapper  # type: ignore[return-value]

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.scope(name):
                    return fn(*args, **kwargs)

            return wrapper  # type: ignore[return-value]

        return decorator

    @contextmanager
    def record_timing(self, key: str) -> Iterator[None]:
        """Record the block's wall time in seconds as scalar ``timeperf/<scopes>/<key>``.

        Timings are grouped under one top-level ``timeperf`` section regardless of scope.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self._add_scalar(_join("timeperf", *self._scopes(), key), elapsed)

    # --------------------------------------------------------------- recording
    def _slot(self, full_key: str, kind: str, reduce_type: ReduceType) -> _Partial:
        """The key's partial, created if absent; the lock must be held."""
        part = self._partials.get(full_key)
        if part is None:
            part = self._partials[full_key] = _Partial(kind, reduce_type)
        elif part.kind != kind or part.reduce_type != reduce_type:
            raise ValueError(
                f"stats_tracker: key {full_key!r} was recorded as {part.kind}/{part.reduce_type.name}, "
                f"now as {kind}/{reduce_type.name}"
            )
        return part

    def _add_scalar(self, full_key: str, value: float) -> None:
        with self._lock:
            part = self._slot(full_key, _SCALAR, ReduceType.SCALAR)
            part.total += value
            part.count += 1.0

    def scalar(self, **values: float | int | torch.Tensor) -> None:
        """Record one sample per key; exported as the mean of samples plus ``key__count``."""
        if _is_muted():
            return
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"stats_tracker.scalar: {key!r} must be a single number, got shape {tuple(value.shape)}"
                    )
                value = value.item()
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"stats_tracker.scalar: {key!r} must be a number, got {type(value).__name__}") from None
            held = _HELD.get()
            if held is not None:
                held.add(self, self._full_key(key), number)
            else:
                self._add_scalar(self._full_key(key), number)

    def denominator(self, **masks: torch.Tensor) -> None:
        """Record boolean masks that later ``stat`` calls refer to; exported as their counts."""
        if _is_muted():
            return
        for key, mask in masks.items():
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise TypeError(f"stats_tracker.denominator: {key!r} must be a bool tensor, got {got}")
            full_key = self._full_key(key)
            mask = mask.detach()
            count = mask.sum(dtype=torch.float64)
            with self._lock:
                part = self._slot(full_key, _DENOM, ReduceType.SUM)
                part.total = part.total + count
                part.count = part.count + count
                self._masks[full_key] = mask

    def stat(self, denominator: str, reduce_type: ReduceType | None = None, **tensors: torch.Tensor) -> None:
        """Record tensors masked by the last mask recorded under ``denominator`` in this scope."""
        if _is_muted():
            return
        reduce_type = ReduceType.AVG_MIN_MAX if reduce_type is None else reduce_type
        if not isinstance(reduce_type, ReduceType):
            raise TypeError(f"stats_tracker.stat: reduce_type must be a ReduceType, got {reduce_type!r}")
        denom_key = self._full_key(denominator)
        with self._lock:
            mask = self._masks.get(denom_key)
        if mask is None:
            raise KeyError(f"stats_tracker.stat: denominator {denom_key!r} was not recorded; call denominator() first")
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"stats_tracker.stat: {key!r} must be a tensor, got {type(value).__name__}")
            if value.shape != mask.shape:
                raise ValueError(
                    f"stats_tracker.stat: {key!r} has shape {tuple(value.shape)} but denominator "
                    f"{denom_key!r} has shape {tuple(mask.shape)}"
                )
            values = value.detach().to(torch.float64)
            m = mask.to(values.device)
            total = torch.where(m, values, 0.0).sum()
            count = m.sum(dtype=torch.float64)
            vmin = torch.where(m, values, float("inf")).min() if values.numel() else values.new_tensor(float("inf"))
            vmax = torch.where(m, values, float("-inf")).max() if values.numel() else values.new_tensor(float("-inf"))
            full_key = self._full_key(key)
            with self._lock:
                part = self._slot(full_key, _STAT, reduce_type)
                part.total = part.total + total
                part.count = part.count + count
                part.vmin = torch.minimum(torch.as_tensor(part.vmin, dtype=torch.float64, device=vmin.device), vmin)
                part.vmax = torch.maximum(torch.as_tensor(part.vmax, dtype=torch.float64, device=vmax.device), vmax)

    # ------------------------------------------------------------------ export
    def _snapshot(self, key: str | None, reset: bool) -> dict[str, _Partial]:
        """Copy (and optionally clear) the partials under ``key``, prefixed with the tracker name."""
        with self._lock:
            selected = [k for k in self._partials if key is None or k == key or k.startswith(key + "/")]
            snap = {_join(self.name, k): self._partials[k].copy() for k in selected}
            if reset:
                for k in selected:
                    del self._partials[k]
                    self._masks.pop(k, None)
        return snap

    def export(
        self, key: str | None = None, reduce_group: dist.ProcessGroup | None = None, reset: bool = True
    ) -> dict[str, float]:
        """Reduce recorded keys (all, or those under ``key``) to floats; collective over ``reduce_group``."""
        return _reduce(self._snapshot(key, reset), reduce_group)

    def reset(self) -> None:
        """Drop everything recorded so far."""
        with self._lock:
            self._partials.clear()
            self._masks.clear()


# ---------------------------------------------------------------------- reduction
def _reduce_device(group: dist.ProcessGroup | None) -> torch.device:
    """Collectives run where the backend wants tensors: the current CUDA device for NCCL, else CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_kinds(snap: dict[str, _Partial], group: dist.ProcessGroup | None) -> dict[str, tuple[str, ReduceType]]:
    """Union of (kind, reduce type) per key over the group, so every rank reduces the same keys."""
    local = {k: (p.kind, p.reduce_type.value) for k, p in snap.items()}
    gathered: list[dict[str, tuple[str, str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    union: dict[str, tuple[str, str]] = {}
    for rank_keys in gathered:
        for k, kind in (rank_keys or {}).items():
            if union.setdefault(k, kind) != kind:
                raise ValueError(
                    f"stats_tracker: key {k!r} is recorded as {union[k]} on one rank and {kind} on another"
                )
    return {k: (kind, ReduceType(rt)) for k, (kind, rt) in union.items()}


def _reduce(snap: dict[str, _Partial], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Turn partials into exported floats, summing/min/max-ing them across ``group`` first."""
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if distributed:
        kinds = _gather_kinds(snap, group)
        device = _reduce_device(group)
    else:
        kinds = {k: (p.kind, p.reduce_type) for k, p in snap.items()}
        device = torch.device("cpu")
    keys = sorted(kinds)
    if not keys:
        return {}

    def column(attr: str, missing: float) -> torch.Tensor:
        vals = []
        for k in keys:
            v = getattr(snap[k], attr) if k in snap else missing
            vals.append(torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()))
        return torch.stack(vals)

    sums = torch.stack([column("total", 0.0), column("count", 0.0)])  # [2, n]
    mins = column("vmin", float("inf"))
    maxs = column("vmax", float("-inf"))
    if distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
    totals, counts = sums[0].tolist(), sums[1].tolist()
    mins_l, maxs_l = mins.tolist(), maxs.tolist()

    out: dict[str, float] = {}
    for i, k in enumerate(keys):
        kind, rt = kinds[k]
        total, count = totals[i], counts[i]
        if kind == _DENOM:
            out[k] = count  # a zero count is still a meaningful value
            continue
        if count <= 0:
            continue  # nothing was selected anywhere: omit rather than export NaN
        if rt is ReduceType.AVG_MIN_MAX:
            out[k + "/avg"] = total / count
            out[k + "/min"] = mins_l[i]
            out[k + "/max"] = maxs_l[i]
        elif rt is ReduceType.AVG:
            out[k] = total / count
        elif rt is ReduceType.SUM:
            out[k] = total
        elif rt is ReduceType.MIN:
            out[k] = mins_l[i]
        elif rt is ReduceType.MAX:
            out[k] = maxs_l[i]
        else:  # SCALAR, from scalar() or stat(reduce_type=SCALAR)
            out[k] = total / count
            out[k + "__count"] = count
    return out


# ------------------------------------------------------------- module-level API
DEFAULT_TRACKER = StatsTracker()
_trackers: dict[str, StatsTracker] = {"": DEFAULT_TRACKER}
_registry_lock = threading.Lock()


def get(name: str = "") -> StatsTracker:
    """The tracker called ``name`` (created on first use); ``""`` is the default tracker."""
    with _registry_lock:
        tracker = _trackers.get(name)
        if tracker is None:
            tracker = _trackers[name] = StatsTracker(name)
        return tracker


def export_all(reduce_group: dist.ProcessGroup | None = None, reset: bool = True) -> dict[str, float]:
    """Export every tracker in one reduction; ranks may have created different named trackers."""
    with _registry_lock:
        trackers = list(_trackers.values())
    snap: dict[str, _Partial] = {}
    for tracker in trackers:
        snap.update(tracker._snapshot(None, reset))
    return _reduce(snap, reduce_group)


def scalar(**values: float | int | torch.Tensor) -> None:
    """Record scalars in the default tracker."""
    DEFAULT_TRACKER.scalar(**values)


def denominator(**masks: torch.Tensor) -> None:
    """Record denominator masks in the default tracker."""
    DEFAULT_TRACKER.denominator(**masks)


def stat(denominator: str, reduce_type: ReduceType | None = None, **tensors: torch.Tensor) -> None:
    """Record masked tensors in the default tracker."""
    DEFAULT_TRACKER.stat(denominator, reduce_type, **tensors)


def scope(name: str) -> AbstractContextManager[None]:
    """Scope keys of the default tracker."""
    return DEFAULT_TRACKER.scope(name)


def scope_func_wrapper(name: str) -> Callable[[F], F]:
    """Decorator scoping the default tracker for a whole function."""
    return DEFAULT_TRACKER.scope_func_wrapper(name)


def record_timing(key: str) -> AbstractContextManager[None]:
    """Time a block into the default tracker."""
    return DEFAULT_TRACKER.record_timing(key)


def export(
    key: str | None = None, reduce_group: dist.ProcessGroup | None = None, reset: bool = True
) -> dict[str, float]:
    """Export the default tracker only (see ``export_all`` for every tracker)."""
    return DEFAULT_TRACKER.export(key, reduce_group, reset)
