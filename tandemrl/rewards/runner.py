"""Run reward functions off the event loop, with a timeout, never letting them crash a rollout.

Reward functions are ordinary (often slow, CPU-bound, occasionally hanging) Python code.
``RewardRunner`` runs a sync function on a pool of *daemon* threads (up to ``max_workers``, 64 by
default, started only as calls overlap, so a latency-bound reward such as a remote check runs as many
calls at once as episodes need) and awaits it with a timeout; an async function is awaited directly. A function that raises, times out
or returns something that is not a finite number yields ``None`` (no reward: the workflows
drop the sample's whole group rather than score it 0), is counted in
``<scope>/reward_failed``, and is logged in one line the first time each kind of failure
occurs (the exception type, a timeout, a non-number, a non-finite number). Python threads cannot be killed: a timed-out call keeps running in
its thread, which the pool replaces so capacity stays constant; being daemon threads,
they never block interpreter exit. A function with ``self_timed = True`` (a remote reward service
that bounds and retries its own requests, ``tandemrl.inference.reward_service``) gets no timeout here:
waiting for its turn under its concurrency cap is not a failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

from tandemrl.api.episode import note_failure, waiting
from tandemrl.utils import stats_tracker

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]


class DaemonThreadPool:
    """Up to ``max_workers`` daemon threads serving a shared queue; one is added only when a call would
    otherwise wait for a busy thread, so a large cap costs nothing until calls overlap."""

    def __init__(self, max_workers: int, name: str = "tandemrl-reward") -> None:
        if max_workers < 1:
            raise ValueError(f"DaemonThreadPool: max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._workers = 0
        self._idle = 0  # workers waiting for a call
        self._queued = 0  # calls no worker has taken yet
        self._abandoned = 0
        self._shutdown = False

    def _spawn_locked(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self.name}-{self._workers + self._abandoned}", daemon=True)
        self._workers += 1
        t.start()

    def _work(self) -> None:
        with self._lock:
            self._idle += 1
        while True:
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is not None:
                    self._queued -= 1
            if item is None:
                return
            fut, fn = item
            result: Any = None
            error: BaseException | None = None
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as e:  # delivered to the caller
                    error = e
            with self._lock:  # idle again before the caller hears back, so its next call needs no new thread
                self._idle += 1
            if not fut.running():
                continue  # cancelled before it started
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"DaemonThreadPool {self.name!r} is shut down")
            self._queued += 1
            if self._queued > self._idle and self._workers < self.max_workers:
                self._spawn_locked()
        self._queue.put((fut, lambda: fn(*args, **kwargs)))
        return fut

    def abandon_one(self) -> None:
        """A worker is stuck in a call nobody waits for any more: add a replacement."""
        with self._lock:
            if self._shutdown:
                return
            self._workers -= 1
            self._abandoned += 1
            self._spawn_locked()

    @property
    def n_abandoned(self) -> int:
        return self._abandoned

    def shutdown(self) -> None:
        """Let idle workers exit (stuck ones exit when their call returns)."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            n = self._workers
        for _ in range(n):
            self._queue.put(None)


class RewardRunner:
    """Computes rewards safely: ``await runner(prompt, completions, ..., **data) -> float``."""

    def __init__(
        self,
        reward_fn: RewardFn,
        timeout: float | None = 15.0,
        max_workers: int = 64,
        stat_scope: str = "rollout",
    ) -> None:
        if not callable(reward_fn):
            raise TypeError(f"RewardRunner: reward_fn must be callable, got {type(reward_fn).__name__}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"RewardRunner: timeout must be positive or None, got {timeout}")
        self.reward_fn = reward_fn
        self.timeout = None if getattr(reward_fn, "self_timed", False) is True else timeout
        self.stat_scope = stat_scope
        self.name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
        # async functions, or objects whose __call__ is async
        self._is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(type(reward_fn).__call__)
        self._pool = None if self._is_async else DaemonThreadPool(max_workers)
        self._lock = threading.Lock()
        self.n_calls = 0
        self.n_errors = 0
        self.n_timeouts = 0
        self.failures: dict[str, int] = {}  # kind -> count; each kind is logged once

    async def __call__(self, *args: Any, **kwargs: Any) -> float | None:
        """The reward, or None (counted, logged once per kind) if the function fails, hangs or returns junk."""
        with self._lock:
            self.n_calls += 1
        with waiting():  # the episode's environment wait (tandemrl.api.episode)
            return await self._score(*args, **kwargs)

    async def _score(self, *args: Any, **kwargs: Any) -> float | None:
        try:
            if self._is_async:
                value = await asyncio.wait_for(self.reward_fn(*args, **kwargs), self.timeout)
            else:
                assert self._pool is not None
                fut = self._pool.submit(self.reward_fn, *args, **kwargs)
                try:
                    value = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
                except asyncio.TimeoutError:
                    if not fut.cancel():  # already running: its thread is stuck with it
                        self._pool.abandon_one()
                    raise
            reward = _as_reward(value)
        except asyncio.TimeoutError:
            self._failed("timeout", f"timed out after {self.timeout}s")
            return None
        except BadReward as e:
            self._failed(e.kind, str(e))
            return None
        except Exception as e:  # a bad reward must never crash the rollout
            text = str(e).strip()
            detail = f"raised {type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip()
            self._failed(f"raised {type(e).__name__}", detail)
            return None
        stats_tracker.get(self.stat_scope).scalar(reward_failed=0.0)
        return reward

    def _failed(self, kind: str, detail: str) -> None:
        with self._lock:
            if kind == "timeout":
                self.n_timeouts += 1
            else:
                self.n_errors += 1
            first = kind not in self.failures
            self.failures[kind] = self.failures.get(kind, 0) + 1
        stats_tracker.get(self.stat_scope).scalar(reward_failed=1.0)
        note_failure(f"reward {kind}", f"reward function {self.name} {detail}")
        if first:  # later ones of this kind are only counted (<scope>/reward_failed)
            logger.warning(
                "reward function %s %s; its group is dropped (first failure of this kind, later ones only counted)",
                self.name,
                detail,
            )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class BadReward(ValueError):
    """The function returned something that is not a finite number; ``kind`` groups the log lines."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _as_reward(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # 1-element tensors / numpy scalars
        value = value.item()
    if not isinstance(value, int | float):
        kind = f"returned {type(value).__name__}"
        raise BadReward(kind, f"{kind}, expected a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise BadReward("returned non-finite", f"returned non-finite {reward}")
    return reward
