"""Run queued rows as episodes on a background event loop, and book each one that finishes.

The middle room of ``WorkflowExecutor`` (``tandemrl.rollout.executor``), between the rows going in
(``tandemrl.rollout.feed``) and the batches going out (the executor). :class:`Episodes` owns the
loop thread (``AsyncTaskRunner``) and the one ``threading.Condition`` that guards the queue, the
running episodes and the finished ones. An episode starts only while capacity allows (the
``StalenessManager``; in deterministic mode the concurrency limit alone) and nothing is paused; each
runs under its ``RolloutKey`` (``tandemrl.api.determinism``). When it finishes, :meth:`_on_done`
books it: the ledger (every sample generated is handed out, discarded or waiting), the staleness
counts, the failure budget, and its result: accepted (waiting for a batch), rejected or failed
(kept for the next wait under error policy "raise").

The executor reads and changes the queue and the results only while holding :attr:`Episodes.cond`
(the ``*_locked`` methods say so in their names).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandemrl.api.determinism import RolloutKey, rollout_key_context
from tandemrl.api.episode import EpisodeNotes, current_notes, notes_in
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.rollout.batches import Accepted, check_trajectory, samples_of
from tandemrl.rollout.failure_budget import FailureBudget, FailureBudgetExceeded
from tandemrl.rollout.ledger import Ledger, Tally, tally_of
from tandemrl.rollout.staleness import StalenessManager
from tandemrl.rollout.task_runner import AsyncTaskRunner
from tandemrl.rollout.whole_groups import workflow_name
from tandemrl.utils import stats_tracker
from tandemrl.utils.cli import first_line

logger = logging.getLogger(__name__)

ShouldAcceptFn = Callable[[TensorDict], bool]

# Fallback period (s) of the launch loop, so a version bumped directly on the engine
# (without executor.set_version) still unblocks capacity.
_TICK_SECONDS = 0.05
# Longest single sleep of a trainer-side wait before it re-checks versions and errors.
_POLL_SECONDS = 0.1
_STALL_WARN_SECONDS = 10.0
ERROR_POLICIES = ("raise", "drop")
# Where the scalars of an episode filtered out by should_accept_fn (dynamic sampling) go: rollout/filtered/reward,
# rollout/filtered/completion_len, ... (a dropped or failed episode's counters, reward_failed..., stay where they are).
FILTERED = "filtered"


@dataclass
class Task:
    """A submitted row waiting to start."""

    data: dict[str, Any]
    workflow: RolloutWorkflow
    should_accept_fn: ShouldAcceptFn | None
    tag: int | None  # the rollout_batch call it belongs to; None for submit()/prepare_batch()
    order: int  # submission order
    key: RolloutKey  # the rollout it belongs to (per-request seeds in deterministic mode)


@dataclass
class Running:
    version: int
    tag: int | None
    order: int


class Episodes:
    """Queued rows, running episodes and finished results, under one condition (:attr:`cond`).

    ``on_rejected(order)`` is called (under :attr:`cond`) for each episode that finishes without an
    accepted trajectory: the executor's feed counts its row as consumed.
    """

    def __init__(
        self,
        config: InferenceClientConfig,
        client: GenerationClient,
        staleness: StalenessManager,
        max_concurrent_rollouts: int,
        deterministic: bool,
        on_rejected: Callable[[int], None],
    ) -> None:
        if config.workflow_error_policy not in ERROR_POLICIES:
            raise ValueError(
                f"InferenceClientConfig.workflow_error_policy must be one of {ERROR_POLICIES}, "
                f"got {config.workflow_error_policy!r}"
            )
        self.config, self.client, self.staleness = config, client, staleness
        self.max_concurrent_rollouts, self.deterministic = max_concurrent_rollouts, deterministic
        self.error_policy = config.workflow_error_policy
        self.tracing = config.enable_rollout_tracing
        self.failure_budget = FailureBudget(config.max_consecutive_drops, config.max_dropped_share, config.drop_window)
        self.ledger = Ledger()
        self._on_rejected = on_rejected

        self.cond = threading.Condition()
        self.input: deque[Task] = deque()
        self.running: dict[int, Running] = {}
        self.accepted: list[Accepted] = []  # untagged results, not yet handed out
        self.tag_results: dict[int, list[Accepted]] = {}
        self.tag_rejections: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self.n_failed = 0
        self.paused = threading.Event()
        self._closing = False
        self.runner: AsyncTaskRunner | None = None
        self._tasks: dict[int, asyncio.Task[tuple[TensorDict | None, bool]]] = {}  # loop thread only
        self._rids = itertools.count()
        self._orders = itertools.count()
        self._seqs = itertools.count()
        self._last_launch_error = 0.0
        self._stall_since: float | None = None
        self._stall_warned = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self.runner is not None:
            return
        self._closing = False
        runner = AsyncTaskRunner()
        runner.start()
        self.runner = runner
        runner.run_coroutine(self._tick())

    def stop(self, timeout: float) -> None:
        """Cancel running episodes and stop the loop thread."""
        runner = self.runner
        if runner is None:
            return
        self._closing = True
        try:
            runner.run_coroutine(self._cancel_all()).result(timeout)
        except Exception as e:  # shutting down regardless
            logger.warning("WorkflowExecutor.destroy: cancelling episodes failed: %s", first_line(e, with_type=True))
        runner.stop(timeout)
        self.runner = None
        with self.cond:
            self.cond.notify_all()

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def require_runner(self) -> AsyncTaskRunner:
        runner = self.runner
        if runner is None or not runner.is_alive():
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first (or it was destroyed)")
        return runner

    def task(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None,
        tag: int | None,
        key: RolloutKey,
    ) -> Task:
        """A new task, numbered in submission order (queue it with ``input.append`` under :attr:`cond`)."""
        return Task(data, workflow, should_accept_fn, tag, next(self._orders), key)

    def capacity(self, version: int) -> int:
        """Rollouts that may start now; in deterministic mode only concurrency bounds them
        (``prepare_batch``'s schedule bounds staleness)."""
        if self.deterministic:
            return self.max_concurrent_rollouts - self.staleness.get_stats().running
        return self.staleness.get_capacity(version)

    # ------------------------------------------------------------------ launching
    def wake(self) -> None:
        runner = self.runner
        if runner is not None and runner.is_alive():
            try:
                runner.call_soon(self._launch_ready)
            except RuntimeError:  # loop closing
                pass

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_SECONDS)
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start queued episodes while capacity allows (loop thread only)."""
        try:
            self._launch_ready_unsafe()
        except Exception as e:  # the loop must survive (e.g. engine version unavailable)
            now = time.monotonic()
            if now - self._last_launch_error > 10.0:
                self._last_launch_error = now
                logger.error("rollout launch loop: %s", first_line(e, with_type=True))

    def _launch_ready_unsafe(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing and not self.paused.is_set():
            with self.cond:
                if not self.input:
                    return
            version = int(self.client.get_version())
            with self.cond:
                if not self.input or self.capacity(version) <= 0:
                    return
                task = self.input.popleft()
                rid = next(self._rids)
                self.staleness.on_submit()
                self.running[rid] = Running(version, task.tag, task.order)
                self.cond.notify_all()  # prepare_batch refills the input queue
            if self.tracing:
                logger.info("rollout %d started at version %d (%s)", rid, version, workflow_name(task.workflow))
            ctx = rollout_key_context(task.key)
            noted = notes_in(ctx)
            held = stats_tracker.hold_in(ctx)
            atask = loop.create_task(self._run_episode(task), name=f"rollout-{rid}", context=ctx)
            self._tasks[rid] = atask
            atask.add_done_callback(functools.partial(self._on_done, rid, task, version, time.monotonic(), noted, held))

    async def _run_episode(self, task: Task) -> tuple[TensorDict | None, bool]:
        """(trajectory or None, accepted). Records ``env_wait``, the seconds the episode waited on its
        environment (``tandemrl.api.episode.waiting``), held with the episode's other scalars."""
        traj = await task.workflow.arun_episode(self.client, task.data)
        notes = current_notes()
        stats_tracker.get(self.config.stats_name).scalar(env_wait=notes.wait_seconds if notes else 0.0)
        if traj is None:
            return None, False
        check_trajectory(traj, task.workflow)
        if task.should_accept_fn is not None and not task.should_accept_fn(traj):
            return traj, False
        return traj, True

    # ------------------------------------------------------------------ booking
    def _count_locked(self, task: Task, traj: TensorDict | None, accepted: bool, failed: bool, noted: Tally) -> None:
        """Ledger entries of a finished episode: the batch it returned counts, else what its workflow noted."""
        got = tally_of(traj) if traj is not None else noted
        self.ledger.generated(got)
        if failed:
            self.ledger.discarded("failed", got)
        elif traj is None:
            self.ledger.discarded("group_dropped", got)
        elif not accepted:
            self.ledger.discarded("filtered", got)
        elif task.tag is not None and task.tag not in self.tag_results:
            self.ledger.discarded("abandoned", got)

    def _on_done(
        self,
        rid: int,
        task: Task,
        version: int,
        start: float,
        noted: EpisodeNotes,
        held: stats_tracker.HeldScalars,
        atask: asyncio.Task[Any],
    ) -> None:
        """Book a finished episode. The scalars its workflow recorded (reward, lengths) are held until the
        trainer consumes it (the executor's hand-out); a rollout_batch result, a dropped or a failed episode
        records them now, and one filtered out records them under ``filtered/``."""
        self._tasks.pop(rid, None)
        cancelled = atask.cancelled()  # a cancelled episode (destroy) never finished
        exc: BaseException | None = asyncio.CancelledError() if cancelled else atask.exception()
        traj, accepted = atask.result() if exc is None else (None, False)
        with self.cond:
            self.running.pop(rid, None)
            if not cancelled:
                self._count_locked(task, traj, accepted, exc is not None, Tally(noted.samples, noted.tokens))
            if accepted:
                assert traj is not None
                done = Accepted(traj, version, next(self._seqs), task.order, task.data, held)
                outcome = self._accept_locked(done, task.tag)
            else:
                outcome = self._reject_locked(task, exc, cancelled)
            if not cancelled:
                self._spend_budget_locked(traj, outcome, exc, noted)
            self.cond.notify_all()
        if outcome == "rejected" and traj is not None:  # filtered out: kept off the trained samples' curves
            held.release(FILTERED)
        elif outcome != "accepted" or task.tag is not None:
            held.release()
        if outcome == "failed" and exc is not None and (self.n_failed <= 10 or self.n_failed % 100 == 0):
            logger.warning(
                "rollout %d: %s raised %s (%s; %d failures so far)",
                rid,
                workflow_name(task.workflow),
                first_line(exc, with_type=True),
                "re-raised at the next wait()" if self.error_policy == "raise" else "dropped",
                self.n_failed,
            )
        elif self.tracing:
            logger.info("rollout %d %s after %.3fs", rid, outcome, time.monotonic() - start)
        if not self._closing:
            self._launch_ready()

    def _accept_locked(self, done: Accepted, tag: int | None) -> str:
        self.staleness.on_accept()
        if tag is None:
            self.accepted.append(done)
        elif tag in self.tag_results:
            self.tag_results[tag].append(done)
        # else: its rollout_batch call already gave up; the result is dropped (ledger: abandoned)
        return "accepted"

    def _reject_locked(self, task: Task, exc: BaseException | None, cancelled: bool) -> str:
        self.staleness.on_reject()
        self._on_rejected(task.order)  # consumed untrained, as in any run
        outcome = "rejected"
        if exc is not None and not cancelled:
            outcome = "failed"
            self.n_failed += 1
            if self.error_policy == "raise":
                self.errors.append(exc)
        if task.tag in self.tag_rejections and (outcome == "rejected" or self.error_policy == "drop"):
            self.tag_rejections[task.tag] += 1
        return outcome

    def _spend_budget_locked(
        self, traj: TensorDict | None, outcome: str, exc: BaseException | None, noted: EpisodeNotes
    ) -> None:
        """Count a finished episode against the failure budget; a spent budget fails the next wait()."""
        dropped = outcome == "failed" or (outcome == "rejected" and traj is None)
        causes = list(noted.failures)
        if exc is not None:
            causes.append((f"raised {type(exc).__name__}", first_line(exc)))
        self.ledger.episode(dropped)
        reason = self.failure_budget.record(dropped, causes)
        if reason is not None and not any(isinstance(e, FailureBudgetExceeded) for e in self.errors):
            self.errors.append(FailureBudgetExceeded(reason))

    # ------------------------------------------------------------------ read by the trainer side
    def raise_errors_locked(self) -> None:
        if not self.errors:
            return
        errors, self.errors = self.errors, []
        spent = [e for e in errors if isinstance(e, FailureBudgetExceeded)]
        if spent:
            raise spent[0]
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RuntimeError(
            f"rollout workflow failed: {first_line(first, with_type=True)}{more}; "
            "set InferenceClientConfig.workflow_error_policy='drop' to skip failed rollouts"
        ) from first

    def outstanding_locked(self, before: float = float("inf")) -> bool:
        """Whether an untagged row submitted before order ``before`` is still queued or running."""
        queued = any(t.tag is None and t.order < before for t in self.input)
        return queued or any(r.tag is None and r.order < before for r in self.running.values())

    def in_flight_locked(self) -> Tally:
        """Samples accepted and waiting for a batch, measured from the waiting trajectories."""
        waiting = self.accepted + [d for done in self.tag_results.values() for d in done]
        return samples_of(waiting)

    def describe_locked(self) -> str:
        s = self.staleness.get_stats()
        version = int(self.client.get_version())
        return (
            f"accepted-unconsumed {len(self.accepted)}, running {s.running}, queued {len(self.input)}, "
            f"rejected {s.rejected}, failed {self.n_failed}, capacity {self.capacity(version)}, "
            f"version {version}, paused {self.paused.is_set()}"
        )

    def _warn_if_stalled_locked(self) -> None:
        """Log once per stall when rows wait for a version bump that a blocked trainer cannot make."""
        version = int(self.client.get_version())
        stalled = bool(self.input) and not self.running and not self.paused.is_set() and self.capacity(version) <= 0
        now = time.monotonic()
        if not stalled:
            self._stall_since = None
            return
        if self._stall_since is None:
            self._stall_since, self._stall_warned = now, False
        elif not self._stall_warned and now - self._stall_since > _STALL_WARN_SECONDS:
            self._stall_warned = True
            logger.warning(
                "rollout stalled for %.0fs: %d rows queued, none running, no capacity at version %d; only a "
                "version bump (set_version) frees capacity (check consumer_batch_size/max_head_offpolicyness)",
                now - self._stall_since,
                len(self.input),
                version,
            )

    def sleep_locked(self, deadline: float | None, what: str) -> None:
        """Wait on the condition until woken, the poll period or the deadline (then TimeoutError)."""
        self.require_runner()
        self._warn_if_stalled_locked()
        period = _POLL_SECONDS
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} timed out ({self.describe_locked()})")
            period = min(period, remaining)
        self.cond.wait(period)
