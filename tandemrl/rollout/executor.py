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

Three rooms: ``tandemrl.rollout.feed`` (which rows go in), ``tandemrl.rollout.episodes`` (runs
and books the episodes; owns the loop thread and the one condition) and this module (hands
batches to the trainer, composing the two).

``ledger`` (``tandemrl.rollout.ledger``) accounts for every sample an episode generated: handed
out in a batch, discarded (filtered, dropped by the workflow, failed, abandoned) or waiting;
:meth:`ledger_totals` reads it with the waiting samples measured at the same moment.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from tandemrl.api.determinism import RolloutKey
from tandemrl.api.renamed import RenamedAttribute
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.rollout.batches import Accepted, collate, must_wait_for_older, record_hand_out, samples_of, split_batch
from tandemrl.rollout.episodes import ERROR_POLICIES, Episodes, ShouldAcceptFn
from tandemrl.rollout.failure_budget import FailureBudget
from tandemrl.rollout.feed import Feed
from tandemrl.rollout.ledger import Ledger, LedgerTotals, Tally
from tandemrl.rollout.staleness import RolloutStat, StalenessManager
from tandemrl.utils import stats_tracker

logger = logging.getLogger(__name__)

__all__ = ["ERROR_POLICIES", "ShouldAcceptFn", "WorkflowExecutor"]


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
        self.config = config
        self.consumer_batch_size = consumer_batch_size
        self.max_concurrent_rollouts = config.concurrency(consumer_batch_size)
        self.queue_size = config.queue_size or self.max_concurrent_rollouts * 16
        if self.queue_size < 1:
            raise ValueError(f"InferenceClientConfig.queue_size must be positive, got {config.queue_size}")
        self.staleness = StalenessManager(
            self.max_concurrent_rollouts, consumer_batch_size, config.max_head_offpolicyness
        )
        self.deterministic = deterministic
        self._feed = Feed()
        self._episodes = Episodes(
            config, client, self.staleness, self.max_concurrent_rollouts, deterministic, self._feed.consumed
        )
        self._cond = self._episodes.cond
        self.error_policy, self.tracing = self._episodes.error_policy, self._episodes.tracing  # as configured
        self._tags = itertools.count()
        self.last_batch_rows: list[dict[str, Any]] = []  # the rows behind the last batch handed out

    @property
    def client(self) -> GenerationClient:
        """The inference client the episodes generate with (settable: the episodes use the new one)."""
        return self._episodes.client

    @client.setter
    def client(self, client: GenerationClient) -> None:
        self._episodes.client = client

    @property
    def ledger(self) -> Ledger:
        return self._episodes.ledger

    @property
    def failure_budget(self) -> FailureBudget:
        return self._episodes.failure_budget

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Start the rollout thread (idempotent)."""
        self._episodes.start()

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel running episodes and stop the rollout thread."""
        self._episodes.stop(timeout)

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
        self._episodes.wake()

    def pause(self) -> None:
        """Stop starting new episodes; running ones continue."""
        self._episodes.paused.set()

    def resume(self) -> None:
        self._episodes.paused.clear()
        self._episodes.wake()

    def is_paused(self) -> bool:
        return self._episodes.paused.is_set()

    def get_capacity(self) -> int:
        return self._episodes.capacity(self.get_version())

    # ------------------------------------------------------------------ trainer side
    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
    ) -> None:
        """Queue one row; it starts when capacity allows and is not paused."""
        self._submit(data, workflow, should_accept_fn, RolloutKey(-1))
        self._episodes.wake()

    def _submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None,
        key: RolloutKey,
        pulled: bool = False,
    ) -> None:
        self._episodes.require_runner()
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(workflow).__name__}")
        with self._cond:
            if len(self._episodes.input) >= self.queue_size:
                raise queue.Full(
                    f"rollout input queue is full ({self.queue_size} rows, InferenceClientConfig.queue_size); "
                    "wait() for results before submitting more"
                )
            task = self._episodes.task(data, workflow, should_accept_fn, None, key)
            self._episodes.input.append(task)
            if pulled:
                self._feed.taken(task.order, data)

    def _try_pick_locked(self, count: int) -> list[Accepted] | None:
        episodes = self._episodes
        if len(episodes.accepted) < count:
            return None
        version = self.get_version()
        picked, rest = split_batch(episodes.accepted, count, self.deterministic)
        if self.deterministic:  # the earliest submitted rows, once none before them is still running
            if episodes.outstanding_locked(before=picked[-1].order):
                return None
        else:
            running = [r.version for r in episodes.running.values() if r.tag is None]
            if must_wait_for_older(rest, running, count, version, self.staleness.max_head_offpolicyness):
                return None
        episodes.accepted = rest
        for d in picked:
            self._feed.consumed(d.order)
            d.held.release()  # this step's rollout/* scalars describe the samples it trains on
        self.last_batch_rows = [d.data for d in picked]
        record_hand_out(picked, version, self.ledger, self.config.stats_name)
        return picked

    def _drops(self) -> str:
        """What a give-up line adds when episodes dropped their groups (then the filter was not the cause)."""
        cause = self.failure_budget.main_cause()
        return f"; {cause}" if cause else ""

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

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """``count`` accepted trajectories (oldest version first) concatenated into one padded batch.

        Raises the first workflow error (policy "raise") and TimeoutError after ``timeout`` s.
        """
        self._check_count(count, "wait")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._episodes.raise_errors_locked()
                picked = self._try_pick_locked(count)
                if picked is not None:
                    break
                self._episodes.sleep_locked(deadline, f"wait({count}, timeout={timeout})")
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
        self._feed.use(dataloader)
        episodes = self._episodes
        deadline = None if timeout is None else time.monotonic() + timeout
        refill, rejected_before = False, self.get_stats().rejected
        while True:
            with self._cond:
                refill = refill or self._refill_due_locked(batch_size)
            if refill:
                key = RolloutKey(self._feed.pulls)
                rows = self._next_rows(batch_size)
                self._feed.pulls += 1
                for row in rows:
                    self._submit(row, workflow, should_accept_fn, key, pulled=True)
                episodes.wake()
            with self._cond:
                episodes.raise_errors_locked()
                picked = self._try_pick_locked(batch_size)
                if picked is not None:
                    break
                rejected = self.staleness.get_stats().rejected - rejected_before
                if max_rounds is not None and rejected > batch_size * max_rounds:
                    raise RuntimeError(
                        f"prepare_batch: {rejected} rollouts were rejected and no batch of {batch_size} filled; gave "
                        f"up after {max_rounds} rounds of rejections (loosen should_accept_fn or raise max_rounds, in "
                        f"a trainer actor.dynamic_sampling_rounds){self._drops()}"
                    )
                refill = self._refill_due_locked(batch_size)
                if self.deterministic:  # one more batch once everything submitted finished short of a batch
                    refill = refill or not episodes.outstanding_locked()
                if not refill:
                    episodes.sleep_locked(deadline, f"prepare_batch(batch_size={batch_size}, timeout={timeout})")
        return collate(picked)

    def _refill_due_locked(self, batch_size: int) -> bool:
        """Whether prepare_batch takes the next batch of rows now (``Feed.refill_due``)."""
        version = self.get_version() - self.staleness.base_version if self.deterministic else 0
        queued = len(self._episodes.input)
        bound = self.staleness.max_head_offpolicyness
        return self._feed.refill_due(batch_size, queued, self.queue_size, self.deterministic, version, bound)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every row submitted to this executor (not to ``rollout_batch``) has finished.

        Deterministic mode calls it before each weight update, so no rollout is cut by the update
        and each is generated whole by the weights it started with.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._episodes.outstanding_locked():
                self._episodes.raise_errors_locked()
                self._episodes.sleep_locked(deadline, f"drain(timeout={timeout})")

    def _next_rows(self, batch_size: int) -> list[dict[str, Any]]:
        """Up to ``batch_size`` rows to replay (see :meth:`replay_first`), else the dataloader's next batch."""
        with self._cond:
            rows = self._feed.replayed(batch_size)
        return rows or self._feed.pull()

    def pending_rows(self) -> list[dict[str, Any]]:
        """Rows prepare_batch took from the dataloader whose trajectories no batch has handed out yet
        (queued, running, or accepted and waiting), oldest first; a rejected row counts as consumed.

        With the dataloader's position, this is what a resumed run needs to train every row once:
        pass it to :meth:`replay_first` of the new executor.
        """
        with self._cond:
            return self._feed.pending_rows()

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None:
        """Make prepare_batch submit ``rows`` (e.g. a checkpoint's :meth:`pending_rows`) before new dataloader rows."""
        with self._cond:
            self._feed.replay_first(rows)

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
        episodes = self._episodes
        pending, submitted, seen_rejections = n, 0, 0
        with self._cond:
            episodes.tag_results[tag] = []
            episodes.tag_rejections[tag] = 0
        try:
            while True:
                with self._cond:
                    episodes.raise_errors_locked()
                    if len(episodes.tag_results[tag]) >= n:
                        results = episodes.tag_results.pop(tag)
                        record_hand_out(results, self.get_version(), self.ledger, self.config.stats_name)
                        break
                    rejections = episodes.tag_rejections[tag]
                    pending += rejections - seen_rejections
                    seen_rejections = rejections
                    if submitted + pending > n * (1 + max_rounds):
                        raise RuntimeError(
                            f"rollout_batch: {rejections} of {submitted} rollouts were rejected; gave up after "
                            f"{max_rounds} extra rounds of {n} rows (loosen should_accept_fn or raise max_rounds, in a trainer "
                            f"actor.dynamic_sampling_rounds){self._drops()}"
                        )
                    room = self.queue_size - len(episodes.input)
                    while pending > 0 and room > 0:
                        key = RolloutKey(tag, attempt=submitted // n)  # the k-th pass over data: attempt k
                        episodes.input.append(episodes.task(next(rows), workflow, should_accept_fn, tag, key))
                        pending, submitted, room = pending - 1, submitted + 1, room - 1
                episodes.wake()
                with self._cond:
                    if len(episodes.tag_results[tag]) < n and episodes.tag_rejections[tag] == seen_rejections:
                        episodes.sleep_locked(deadline, f"rollout_batch({n} rows, timeout={timeout})")
        finally:
            with self._cond:
                left = episodes.tag_results.pop(tag, [])  # accepted, never handed out: the call gave up
                self.ledger.discarded("abandoned", samples_of(left))
                episodes.tag_rejections.pop(tag, None)
        results = sorted(results, key=lambda d: d.order)
        self.last_batch_rows = [d.data for d in results]
        return collate(results)

    # ------------------------------------------------------------------ ledger
    def ledger_totals(self) -> LedgerTotals:
        """The ledger with the samples in flight and the episodes queued or running, read at one moment."""
        episodes = self._episodes
        with self._cond:
            return self.ledger.totals(episodes.in_flight_locked(), len(episodes.input) + len(episodes.running))

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(:meth:`pending_rows`, the ledger's state) read at one moment, for a recoverable checkpoint."""
        with self._cond:
            return self.pending_rows(), self.ledger.state_dict(self._episodes.in_flight_locked())

    def restore_ledger(self, state: dict[str, Any]) -> Tally:
        """Continue a checkpoint's ledger; its samples in flight become ``lost_at_restart`` (returned)."""
        with self._cond:
            return self.ledger.load_state_dict(state)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> RolloutStat:
        return self.staleness.get_stats()

    @property
    def n_failed(self) -> int:
        return self._episodes.n_failed

    def export_stats(self, reset: bool = True, reduce_group: Any = None) -> dict[str, float]:
        """Rollout counters plus everything in the ``config.stats_name`` tracker (keys ``<stats_name>/...``).

        ``in_flight``: episodes running or finished and not yet trained on, now (at a step's end: the work
        under way for the next steps; 0 in a synchronous run)."""
        with self._cond:
            s = self.staleness.get_stats()
            in_flight = s.running + len(self._episodes.accepted)  # episodes under way for the next batches
        tracker = stats_tracker.get(self.config.stats_name)
        tracker.scalar(
            submitted=s.submitted,
            accepted=s.accepted,
            rejected=s.rejected,
            running=s.running,
            failed=self._episodes.n_failed,
            in_flight=in_flight,
        )
        return tracker.export(reduce_group=reduce_group, reset=reset)
