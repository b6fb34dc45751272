"""Run rollout workflows on a background event loop and hand finished batches to the trainer.

The trainer thread (usually through ``RolloutController``) calls ``submit``/``wait``/
``prepare_batch``/``rollout_batch``; a daemon thread (``AsyncTaskRunner``) owns an asyncio
loop on which every episode runs as a task. Episodes start only while the
``StalenessManager`` grants capacity, and ``wait`` hands out accepted trajectories
oldest-weight-version first, holding back a batch when that is needed for an older, still
running rollout to be consumed in time. Together this guarantees that a rollout started at
weight version v is consumed by a trainer at version <= v + max_head_offpolicyness,
provided the trainer consumes ``consumer_batch_size`` trajectories per version bump.

Deterministic mode (``deterministic=True``): batches are the trajectories of the earliest
submitted rows, in submission order (never completion order); ``prepare_batch`` takes rows from
the dataloader on a fixed schedule (at weight version v, until it has taken v + k + 1 batches,
k = ``max_head_offpolicyness``; one more batch only when everything submitted has finished
without filling the batch), the staleness capacity is replaced by that schedule, and
:meth:`drain` lets a weight update wait for every submitted rollout, so each one is generated
whole by the weights it started with. Each episode runs under its ``RolloutKey``
(``tandemrl.api.determinism``), from which workflows derive per-request sampling seeds.

``pending_rows`` lists the rows ``prepare_batch`` took from the dataloader that no batch has
handed out yet; a recoverable checkpoint saves them and the resumed executor submits them
first (``replay_first``), so a restart neither skips nor repeats a row.

``ledger`` (``tandemrl.rollout.ledger``) accounts for every sample an episode generated: handed
out in a batch, discarded (filtered, dropped by the workflow, failed, abandoned) or waiting;
:meth:`ledger_totals` reads it with the waiting samples measured at the same moment.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandemrl.api.determinism import RolloutKey, rollout_key_context
from tandemrl.api.episode import EpisodeNotes, current_notes, notes_in
from tandemrl.api.renamed import RenamedAttribute
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.data.loader import cycle_batches
from tandemrl.rollout.batches import (
    Accepted,
    check_trajectory,
    collate,
    must_wait_for_older,
    record_hand_out,
    samples_of,
    split_batch,
)
from tandemrl.rollout.failure_budget import FailureBudget, FailureBudgetExceeded
from tandemrl.rollout.ledger import Ledger, LedgerTotals, Tally, tally_of
from tandemrl.rollout.staleness import RolloutStat, StalenessManager
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


@dataclass
class _Task:
    """A submitted row waiting to start."""

    data: dict[str, Any]
    workflow: RolloutWorkflow
    should_accept_fn: ShouldAcceptFn | None
    tag: int | None  # the rollout_batch call it belongs to; None for submit()/prepare_batch()
    order: int  # submission order
    key: RolloutKey  # the rollout it belongs to (per-request seeds in deterministic mode)
    pulled: bool = False  # prepare_batch took it from the dataloader


@dataclass
class _Running:
    version: int
    tag: int | None
    order: int


class WorkflowExecutor:
    """Streams rollouts of submitted rows and collates accepted ones into training batches."""

    if not TYPE_CHECKING:  # the old name fails with the line naming the new one (tandemrl.api.renamed)
        inference_engine = RenamedAttribute("client")

    def __init__(
        self,
        config: InferenceClientConfig,
        client: GenerationClient,
        consumer_batch_size: int = 1,
        deterministic: bool = False,
    ) -> None:
        """``consumer_batch_size``: trajectories one training step consumes (the staleness unit);
        ``deterministic``: see the module docstring."""
        if config.workflow_error_policy not in ERROR_POLICIES:
            raise ValueError(
                f"InferenceClientConfig.workflow_error_policy must be one of {ERROR_POLICIES}, "
                f"got {config.workflow_error_policy!r}"
            )
        self.config = config
        self.client = client
        self.consumer_batch_size = consumer_batch_size
        self.max_concurrent_rollouts = config.concurrency(consumer_batch_size)
        self.queue_size = config.queue_size or self.max_concurrent_rollouts * 16
        if self.queue_size < 1:
            raise ValueError(f"InferenceClientConfig.queue_size must be positive, got {config.queue_size}")
        self.staleness = StalenessManager(
            self.max_concurrent_rollouts, consumer_batch_size, config.max_head_offpolicyness
        )
        self.error_policy = config.workflow_error_policy
        self.failure_budget = FailureBudget(config.max_consecutive_drops, config.max_dropped_share, config.drop_window)
        self.tracing = config.enable_rollout_tracing
        self.deterministic = deterministic

        self._cond = threading.Condition()
        self._input: deque[_Task] = deque()
        self._accepted: list[Accepted] = []  # untagged results, not yet handed out
        self._tag_results: dict[int, list[Accepted]] = {}
        self._tag_rejections: dict[int, int] = {}
        self._running: dict[int, _Running] = {}
        self._errors: list[BaseException] = []
        self._n_failed = 0
        self._paused = threading.Event()
        self._closing = False
        self._runner: AsyncTaskRunner | None = None
        self._tasks: dict[int, asyncio.Task[tuple[TensorDict | None, bool]]] = {}  # loop thread only
        self._rids = itertools.count()
        self._orders = itertools.count()
        self._seqs = itertools.count()
        self._tags = itertools.count()
        self._pulls = 0  # batches prepare_batch took (from replay or the dataloader): the rollout index
        self._data_iter: Iterator[Any] | None = None
        self._data_source: Any = None
        self._pending: dict[int, dict[str, Any]] = {}  # order -> row pulled by prepare_batch, not handed out
        self._replay: deque[dict[str, Any]] = deque()  # rows prepare_batch submits before pulling new ones
        self.last_batch_rows: list[dict[str, Any]] = []  # the rows behind the last batch handed out
        self._last_launch_error = 0.0
        self._stall_since: float | None = None
        self._stall_warned = False
        self.ledger = Ledger()

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Start the rollout thread (idempotent)."""
        if self._runner is not None:
            return
        self._closing = False
        runner = AsyncTaskRunner()
        runner.start()
        self._runner = runner
        runner.run_coroutine(self._tick())

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel running episodes and stop the rollout thread."""
        runner = self._runner
        if runner is None:
            return
        self._closing = True
        try:
            runner.run_coroutine(self._cancel_all()).result(timeout)
        except Exception as e:  # shutting down regardless
            logger.warning("WorkflowExecutor.destroy: cancelling episodes failed: %s", first_line(e, with_type=True))
        runner.stop(timeout)
        self._runner = None
        with self._cond:
            self._cond.notify_all()

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _require_runner(self) -> AsyncTaskRunner:
        runner = self._runner
        if runner is None or not runner.is_alive():
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first (or it was destroyed)")
        return runner

    # ------------------------------------------------------------ version/pause
    def get_version(self) -> int:
        """The weight version of the inference client (the source of truth)."""
        return int(self.client.get_version())

    def set_version(self, version: int) -> None:
        """Set the engine's version (if it differs) and re-evaluate capacity now."""
        if self.get_version() != version:
            setter = getattr(self.client, "set_version", None)
            if setter is None:
                raise AttributeError(f"{type(self.client).__name__} has no set_version(); cannot set it")
            setter(version)
        self._wake()

    def pause(self) -> None:
        """Stop starting new episodes; running ones continue."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake()

    def is_paused(self) -> bool:
        return self._paused.is_set()

    def get_capacity(self) -> int:
        return self._capacity(self.get_version())

    def _capacity(self, version: int) -> int:
        """Rollouts that may start now; in deterministic mode only concurrency bounds them
        (``prepare_batch``'s schedule bounds staleness)."""
        if self.deterministic:
            return self.max_concurrent_rollouts - self.staleness.get_stats().running
        return self.staleness.get_capacity(version)

    # ------------------------------------------------------------------ launching
    def _wake(self) -> None:
        runner = self._runner
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
        while not self._closing and not self._paused.is_set():
            with self._cond:
                if not self._input:
                    return
            version = self.get_version()
            with self._cond:
                if not self._input or self._capacity(version) <= 0:
                    return
                task = self._input.popleft()
                rid = next(self._rids)
                self.staleness.on_submit()
                self._running[rid] = _Running(version, task.tag, task.order)
                self._cond.notify_all()  # prepare_batch refills the input queue
            if self.tracing:
                logger.info("rollout %d started at version %d (%s)", rid, version, workflow_name(task.workflow))
            ctx = rollout_key_context(task.key)
            noted = notes_in(ctx)
            held = stats_tracker.hold_in(ctx)
            atask = loop.create_task(self._run_episode(task), name=f"rollout-{rid}", context=ctx)
            self._tasks[rid] = atask
            atask.add_done_callback(functools.partial(self._on_done, rid, task, version, time.monotonic(), noted, held))

    async def _run_episode(self, task: _Task) -> tuple[TensorDict | None, bool]:
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

    def _count_locked(self, task: _Task, traj: TensorDict | None, accepted: bool, failed: bool, noted: Tally) -> None:
        """Ledger entries of a finished episode: the batch it returned counts, else what its workflow noted."""
        got = tally_of(traj) if traj is not None else noted
        self.ledger.generated(got)
        if failed:
            self.ledger.discarded("failed", got)
        elif traj is None:
            self.ledger.discarded("group_dropped", got)
        elif not accepted:
            self.ledger.discarded("filtered", got)
        elif task.tag is not None and task.tag not in self._tag_results:
            self.ledger.discarded("abandoned", got)

    def _on_done(
        self,
        rid: int,
        task: _Task,
        version: int,
        start: float,
        noted: EpisodeNotes,
        held: stats_tracker.HeldScalars,
        atask: asyncio.Task[Any],
    ) -> None:
        """Book a finished episode. The scalars its workflow recorded (reward, lengths) are held until the
        trainer consumes it (``_try_pick_locked``); any other outcome records them now."""
        self._tasks.pop(rid, None)
        exc: BaseException | None = None
        traj: TensorDict | None = None
        accepted = False
        if atask.cancelled():
            exc = asyncio.CancelledError()
        else:
            exc = atask.exception()
            if exc is None:
                traj, accepted = atask.result()
        with self._cond:
            self._running.pop(rid, None)
            if not atask.cancelled():  # a cancelled episode (destroy) never finished
                self._count_locked(task, traj, accepted, exc is not None, Tally(noted.samples, noted.tokens))
            if accepted:
                assert traj is not None
                self.staleness.on_accept()
                done = Accepted(traj, version, next(self._seqs), task.order, task.data, held)
                if task.tag is None:
                    self._accepted.append(done)
                elif task.tag in self._tag_results:
                    self._tag_results[task.tag].append(done)
                # else: its rollout_batch call already gave up; the result is dropped (ledger: abandoned)
                outcome = "accepted"
            else:
                self.staleness.on_reject()
                self._pending.pop(task.order, None)  # consumed untrained, as in any run
                outcome = "rejected"
                if exc is not None and not atask.cancelled():
                    outcome = "failed"
                    self._n_failed += 1
                    if self.error_policy == "raise":
                        self._errors.append(exc)
                if task.tag in self._tag_rejections and (outcome == "rejected" or self.error_policy == "drop"):
                    self._tag_rejections[task.tag] += 1
            if not atask.cancelled():
                self._spend_budget_locked(traj, outcome, exc, noted)
            self._cond.notify_all()
        if outcome != "accepted" or task.tag is not None:
            held.release()
        if outcome == "failed" and exc is not None and (self._n_failed <= 10 or self._n_failed % 100 == 0):
            logger.warning(
                "rollout %d: %s raised %s (%s; %d failures so far)",
                rid,
                workflow_name(task.workflow),
                first_line(exc, with_type=True),
                "re-raised at the next wait()" if self.error_policy == "raise" else "dropped",
                self._n_failed,
            )
        elif self.tracing:
            logger.info("rollout %d %s after %.3fs", rid, outcome, time.monotonic() - start)
        if not self._closing:
            self._launch_ready()

    # ------------------------------------------------------------------ trainer side
    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
    ) -> None:
        """Queue one row; it starts when capacity allows and is not paused."""
        self._submit(data, workflow, should_accept_fn, None, RolloutKey(-1))
        self._wake()

    def _submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None,
        tag: int | None,
        key: RolloutKey,
        pulled: bool = False,
    ) -> None:
        self._require_runner()
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(workflow).__name__}")
        with self._cond:
            if len(self._input) >= self.queue_size:
                raise queue.Full(
                    f"rollout input queue is full ({self.queue_size} rows, InferenceClientConfig.queue_size); "
                    "wait() for results before submitting more"
                )
            task = _Task(data, workflow, should_accept_fn, tag, next(self._orders), key, pulled)
            self._input.append(task)
            if pulled:
                self._pending[task.order] = data

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
        if reason is not None and not any(isinstance(e, FailureBudgetExceeded) for e in self._errors):
            self._errors.append(FailureBudgetExceeded(reason))

    def _raise_errors_locked(self) -> None:
        if not self._errors:
            return
        errors, self._errors = self._errors, []
        spent = [e for e in errors if isinstance(e, FailureBudgetExceeded)]
        if spent:
            raise spent[0]
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RuntimeError(
            f"rollout workflow failed: {first_line(first, with_type=True)}{more}; "
            "set InferenceClientConfig.workflow_error_policy='drop' to skip failed rollouts"
        ) from first

    def _outstanding_locked(self, before: float = float("inf")) -> bool:
        """Whether an untagged row submitted before order ``before`` is still queued or running."""
        queued = any(t.tag is None and t.order < before for t in self._input)
        return queued or any(r.tag is None and r.order < before for r in self._running.values())

    def _try_pick_locked(self, count: int) -> list[Accepted] | None:
        if len(self._accepted) < count:
            return None
        version = self.get_version()
        picked, rest = split_batch(self._accepted, count, self.deterministic)
        if self.deterministic:  # the earliest submitted rows, once none before them is still running
            if self._outstanding_locked(before=picked[-1].order):
                return None
        else:
            running = [r.version for r in self._running.values() if r.tag is None]
            if must_wait_for_older(rest, running, count, version, self.staleness.max_head_offpolicyness):
                return None
        self._accepted = rest
        for d in picked:
            self._pending.pop(d.order, None)
            d.held.release()  # this step's rollout/* scalars describe the samples it trains on
        self.last_batch_rows = [d.data for d in picked]
        record_hand_out(picked, version, self.ledger, self.config.stats_name)
        return picked

    def _describe_locked(self) -> str:
        s = self.staleness.get_stats()
        return (
            f"accepted-unconsumed {len(self._accepted)}, running {s.running}, queued {len(self._input)}, "
            f"rejected {s.rejected}, failed {self._n_failed}, capacity {self.get_capacity()}, "
            f"version {self.get_version()}, paused {self.is_paused()}"
        )

    def _check_count(self, count: int, what: str) -> None:
        """Refuse batch sizes the staleness bound can never supply (a sure deadlock)."""
        if count < 1:
            raise ValueError(f"{what}: needs at least 1 trajectory, got {count}")
        bound, bsz = self.staleness.max_head_offpolicyness, self.consumer_batch_size
        if count > (bound + 1) * bsz:
            raise ValueError(
                f"{what}: needs {count} trajectories but consumer_batch_size={bsz} with "
                f"max_head_offpolicyness={bound} lets at most {(bound + 1) * bsz} start per weight version; set "
                "consumer_batch_size to the per-step batch size (or a huge max_head_offpolicyness for evaluation)"
            )

    def _warn_if_stalled_locked(self) -> None:
        """Log once per stall when rows wait for a version bump that a blocked trainer cannot make."""
        stalled = bool(self._input) and not self._running and not self.is_paused() and self.get_capacity() <= 0
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
                len(self._input),
                self.get_version(),
            )

    def _sleep_locked(self, deadline: float | None, what: str) -> None:
        """Wait on the condition until woken, the poll period or the deadline (then TimeoutError)."""
        self._require_runner()
        self._warn_if_stalled_locked()
        period = _POLL_SECONDS
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} timed out ({self._describe_locked()})")
            period = min(period, remaining)
        self._cond.wait(period)

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """``count`` accepted trajectories (oldest version first) concatenated into one padded batch.

        Raises the first workflow error (policy "raise") and TimeoutError after ``timeout`` s.
        """
        self._check_count(count, "wait")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_errors_locked()
                picked = self._try_pick_locked(count)
                if picked is not None:
                    break
                self._sleep_locked(deadline, f"wait({count}, timeout={timeout})")
        return collate(picked)

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
        timeout: float | None = None,
        max_rounds: int | None = None,
    ) -> TensorDict:
        """The next ``dataloader.batch_size`` accepted trajectories (asynchronous RL).

        Keeps at least one dataloader batch queued ahead of the running episodes, so
        rollouts for the next steps run while the trainer trains. Rejected rows are replaced
        by new rows from the (endlessly re-iterated) dataloader, so the size is constant. With
        ``max_rounds``, a call that has seen more than ``max_rounds`` batches' worth of rollouts rejected
        and still has no batch gives up with a one-line error, as :meth:`rollout_batch` does.
        """
        batch_size = getattr(dataloader, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"prepare_batch: dataloader.batch_size must be a positive int, got {batch_size!r}")
        self._check_count(batch_size, "prepare_batch")
        if self.queue_size < batch_size:
            raise ValueError(
                f"prepare_batch: InferenceClientConfig.queue_size={self.queue_size} is smaller than the "
                f"dataloader batch size {batch_size}"
            )
        if self._data_iter is None or self._data_source is not dataloader:
            self._data_iter, self._data_source = cycle_batches(dataloader), dataloader
        deadline = None if timeout is None else time.monotonic() + timeout
        refill, rejected_before = False, self.get_stats().rejected
        while True:
            with self._cond:
                refill = refill or self._refill_due_locked(batch_size)
            if refill:
                key = RolloutKey(self._pulls)
                rows = self._next_rows(batch_size)
                self._pulls += 1
                for row in rows:
                    self._submit(row, workflow, should_accept_fn, None, key, pulled=True)
                self._wake()
            with self._cond:
                self._raise_errors_locked()
                picked = self._try_pick_locked(batch_size)
                if picked is not None:
                    break
                rejected = self.staleness.get_stats().rejected - rejected_before
                if max_rounds is not None and rejected > batch_size * max_rounds:
                    raise RuntimeError(
                        f"prepare_batch: {rejected} rollouts were rejected and no batch of {batch_size} filled; gave "
                        f"up after {max_rounds} rounds of rejections (loosen should_accept_fn or raise max_rounds, in "
                        "a trainer actor.dynamic_sampling_rounds)"
                    )
                refill = self._refill_due_locked(batch_size)
                if self.deterministic:  # one more batch once everything submitted finished short of a batch
                    refill = refill or not self._outstanding_locked()
                if not refill:
                    self._sleep_locked(deadline, f"prepare_batch(batch_size={batch_size}, timeout={timeout})")
        return collate(picked)

    def _refill_due_locked(self, batch_size: int) -> bool:
        """Whether prepare_batch takes the next batch of rows now: while fewer than a batch are
        queued, or in deterministic mode while it has taken fewer than v + k + 1 batches at version v."""
        if self.deterministic:
            version = self.get_version() - self.staleness.base_version
            return self._pulls < version + self.staleness.max_head_offpolicyness + 1
        return len(self._input) < batch_size and self.queue_size - len(self._input) >= batch_size

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every row submitted to this executor (not to ``rollout_batch``) has finished.

        Deterministic mode calls it before each weight update, so no rollout is cut by the update
        and each is generated whole by the weights it started with.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._outstanding_locked():
                self._raise_errors_locked()
                self._sleep_locked(deadline, f"drain(timeout={timeout})")

    def _next_rows(self, batch_size: int) -> list[dict[str, Any]]:
        """Up to ``batch_size`` rows to replay (see :meth:`replay_first`), else the dataloader's next batch."""
        with self._cond:
            if self._replay:
                return [self._replay.popleft() for _ in range(min(batch_size, len(self._replay)))]
        assert self._data_iter is not None
        try:
            rows = next(self._data_iter)
        except Exception:
            self._data_iter = None  # start over (a fresh pass) on the next call
            raise
        if not isinstance(rows, list | tuple):
            raise TypeError(
                f"prepare_batch: the dataloader must yield lists of rows (collate_fn=collate_as_list), "
                f"got {type(rows).__name__}"
            )
        return list(rows)

    def pending_rows(self) -> list[dict[str, Any]]:
        """Rows prepare_batch took from the dataloader whose trajectories no batch has handed out yet
        (queued, running, or accepted and waiting), oldest first; a rejected row counts as consumed.

        With the dataloader's position, this is what a resumed run needs to train every row once:
        pass it to :meth:`replay_first` of the new executor.
        """
        with self._cond:
            return [self._pending[o] for o in sorted(self._pending)] + list(self._replay)

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None:
        """Make prepare_batch submit ``rows`` (e.g. a checkpoint's :meth:`pending_rows`) before new dataloader rows."""
        with self._cond:
            self._replay.extend(rows)

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
        timeout: float | None = None,
        max_rounds: int = 8,
        refill: Iterator[dict[str, Any]] | None = None,
    ) -> TensorDict:
        """Run ``data`` now and return ``len(data)`` accepted trajectories (synchronous RL, eval).

        A rejected row (filtered, None, or failed with policy "drop") is replaced so the batch
        size stays constant: by the next row of ``refill`` (new prompts, as DAPO's dynamic
        sampling draws them), or without ``refill`` (or once it is exhausted) by the next row of
        ``data`` taken round-robin. Gives up with an error after ``max_rounds * len(data)``
        extra submissions. Results follow submission order.
        """
        n = len(data)
        if n == 0:
            raise ValueError("rollout_batch: data is empty")
        self._check_count(n, "rollout_batch")
        if max_rounds < 1:
            raise ValueError(f"rollout_batch: max_rounds must be >= 1, got {max_rounds}")
        deadline = None if timeout is None else time.monotonic() + timeout
        rows = itertools.chain(data, refill or (), itertools.cycle(data))
        tag = next(self._tags)
        pending, submitted, seen_rejections = n, 0, 0
        with self._cond:
            self._tag_results[tag] = []
            self._tag_rejections[tag] = 0
        try:
            while True:
                with self._cond:
                    self._raise_errors_locked()
                    if len(self._tag_results[tag]) >= n:
                        results = self._tag_results.pop(tag)
                        record_hand_out(results, self.get_version(), self.ledger, self.config.stats_name)
                        break
                    rejections = self._tag_rejections[tag]
                    pending += rejections - seen_rejections
                    seen_rejections = rejections
                    if submitted + pending > n * (1 + max_rounds):
                        raise RuntimeError(
                            f"rollout_batch: {rejections} of {submitted} rollouts were rejected; gave up after "
                            f"{max_rounds} extra rounds of {n} rows (loosen should_accept_fn or raise max_rounds, in a trainer "
                            "actor.dynamic_sampling_rounds)"
                        )
                    room = self.queue_size - len(self._input)
                    while pending > 0 and room > 0:
                        key = RolloutKey(tag, attempt=submitted // n)  # the k-th pass over data: attempt k
                        self._input.append(_Task(next(rows), workflow, should_accept_fn, tag, next(self._orders), key))
                        pending, submitted, room = pending - 1, submitted + 1, room - 1
                self._wake()
                with self._cond:
                    if len(self._tag_results[tag]) < n and self._tag_rejections[tag] == seen_rejections:
                        self._sleep_locked(deadline, f"rollout_batch({n} rows, timeout={timeout})")
        finally:
            with self._cond:
                left = self._tag_results.pop(tag, [])  # accepted, never handed out: the call gave up
                self.ledger.discarded("abandoned", samples_of(left))
                self._tag_rejections.pop(tag, None)
        results = sorted(results, key=lambda d: d.order)
        self.last_batch_rows = [d.data for d in results]
        return collate(results)

    # ------------------------------------------------------------------ ledger
    def _in_flight_locked(self) -> Tally:
        """Samples accepted and waiting for a batch, measured from the waiting trajectories."""
        waiting = self._accepted + [d for done in self._tag_results.values() for d in done]
        return samples_of(waiting)

    def ledger_totals(self) -> LedgerTotals:
        """The ledger with the samples in flight and the episodes queued or running, read at one moment."""
        with self._cond:
            return self.ledger.totals(self._in_flight_locked(), len(self._input) + len(self._running))

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(:meth:`pending_rows`, the ledger's state) read at one moment, for a recoverable checkpoint."""
        with self._cond:
            return self.pending_rows(), self.ledger.state_dict(self._in_flight_locked())

    def restore_ledger(self, state: dict[str, Any]) -> Tally:
        """Continue a checkpoint's ledger; its samples in flight become ``lost_at_restart`` (returned)."""
        with self._cond:
            return self.ledger.load_state_dict(state)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> RolloutStat:
        return self.staleness.get_stats()

    @property
    def n_failed(self) -> int:
        return self._n_failed

    def export_stats(self, reset: bool = True, reduce_group: Any = None) -> dict[str, float]:
        """Rollout counters plus everything in the ``config.stats_name`` tracker (keys ``<stats_name>/...``).

        ``in_flight``: episodes running or finished and not yet trained on, now (at a step's end: the work
        under way for the next steps; 0 in a synchronous run)."""
        with self._cond:
            s = self.staleness.get_stats()
            in_flight = s.running + len(self._accepted)  # episodes under way for the next batches
        tracker = stats_tracker.get(self.config.stats_name)
        tracker.scalar(
            submitted=s.submitted,
            accepted=s.accepted,
            rejected=s.rejected,
            running=s.running,
            failed=self._n_failed,
            in_flight=in_flight,
        )
        return tracker.export(reduce_group=reduce_group, reset=reset)
