"""The trainer's one handle on rollout: next batch, pause/resume, weight push, recovery rows, stats.

A ``RolloutController`` joins three peers that know nothing of each other: an inference
client (generation and the servers' weight-receive calls), a training engine (training and
weight export) and the ``WorkflowExecutor`` that streams episodes through the client. Every
trainer rank builds one; batch and weight methods are collective over all trainer ranks::

    client = RemoteInferenceClient.for_backend("vllm", config.rollout); client.initialize()
    rollout = RolloutController(client, actor, config.rollout, meta, eval_stats_name="eval-rollout",
                                consumer_batch_size=batch_size // dp_world_size)
    batch = rollout.prepare_batch(train_dl, workflow, granularity=group_size)  # or rollout_batch(rows, ...)
    ...train on batch...
    rollout.push_weights(version)  # servers, engine, client and executor all at ``version``
    rollout.destroy(); client.destroy()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch.distributed as dist

from tandemrl.api.engine import TrainBackend
from tandemrl.api.inference import WeightUpdateMeta
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.rollout.distributed import collect
from tandemrl.rollout.executor import ShouldAcceptFn, WorkflowExecutor
from tandemrl.rollout.ledger import Ledger, LedgerTotals, Tally
from tandemrl.rollout.whole_groups import WholeGroups
from tandemrl.utils import stats_tracker
from tandemrl.weights.push import SyncStats, WeightPusher, WeightReceiver

# Evaluation trains on nothing it generates, so no staleness bound applies to it.
UNBOUNDED_STALENESS = 10**6


class InferenceClient(GenerationClient, WeightReceiver, Protocol):
    """What the controller needs of an inference client (``RemoteInferenceClient`` implements it)."""

    def set_version(self, version: int) -> None: ...

    def take_busy_seconds(self) -> float:
        """Seconds with at least one generate request in flight since the last call."""
        ...

    def take_resubmitted_tokens(self) -> int:
        """Prompt + partial-output tokens resubmitted after a pause aborted them, since the last call."""
        ...


class RolloutController:
    """Rollout as a peer of training; see the module docstring.

    ``consumer_batch_size``: trajectories one training step takes from this rank's executor (the
    unit of the staleness bound; the trainer passes ``train_dataset.batch_size`` per DP rank).
    ``eval_stats_name``: also run an evaluation executor (never staleness-throttled, its
    statistics under that tracker name) for :meth:`eval_batch`.
    ``deterministic``: rollouts in submission order, and each weight update waits for the running
    ones on every rank instead of interrupting them (``WorkflowExecutor``'s deterministic mode).
    """

    def __init__(
        self,
        client: InferenceClient,
        engine: TrainBackend,
        config: InferenceClientConfig,
        meta: WeightUpdateMeta | None = None,
        eval_stats_name: str | None = None,
        consumer_batch_size: int = 1,
        deterministic: bool = False,
    ) -> None:
        self.client, self.engine, self.config, self.meta = client, engine, config, meta
        self.deterministic = deterministic
        self._pusher = WeightPusher(engine, client)
        self._executor = WorkflowExecutor(config, client, consumer_batch_size, deterministic)
        self._eval_executor: WorkflowExecutor | None = None
        if eval_stats_name is not None:
            eval_config = dataclasses.replace(
                config, max_head_offpolicyness=UNBOUNDED_STALENESS, stats_name=eval_stats_name
            )
            self._eval_executor = WorkflowExecutor(eval_config, client, consumer_batch_size, deterministic)
        self._destroyed = False
        self._wrapped: dict[tuple[int, int], WholeGroups] = {}  # (workflow id, group rows) -> its WholeGroups
        try:
            for executor in self._executors():
                executor.initialize()
        except BaseException:
            self.destroy()
            raise

    def _executors(self) -> list[WorkflowExecutor]:
        return [self._executor] + ([self._eval_executor] if self._eval_executor is not None else [])

    def _require_live(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(
                f"RolloutController.{what}() after destroy(); build a new RolloutController(client, engine, ...)"
            )

    # ------------------------------------------------------------------ batches
    def _whole(self, workflow: RolloutWorkflow, granularity: int) -> RolloutWorkflow:
        """``workflow`` wrapped in ``WholeGroups`` for groups of ``granularity`` > 1 (one wrapper per workflow)."""
        if granularity <= 1 or isinstance(workflow, WholeGroups):
            return workflow
        key = (id(workflow), granularity)
        wrapped = self._wrapped.get(key)
        if wrapped is None or wrapped.workflow is not workflow:
            wrapped = self._wrapped[key] = WholeGroups(workflow, granularity)
        return wrapped

    def _collect(self, what: str, produce: Callable[[], TensorDict], granularity: int | None) -> TensorDict:
        self._require_live(what)
        return collect(self.engine, produce, granularity)

    def rollout_batch(
        self,
        rows: list[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
        granularity: int = 1,
        timeout: float | None = None,
        refill: Iterator[dict[str, Any]] | None = None,
        max_rounds: int = 8,
    ) -> TensorDict:
        """Synchronous rollout of this replica's ``rows``, then DP redistribution (groups of ``granularity`` kept whole).

        With ``granularity`` > 1 an episode that does not return exactly that many rows drops its group
        (``rollout.whole_groups``). Rows ``should_accept_fn`` rejects are replaced from ``refill`` (e.g.
        the next dataloader rows), else by ``rows`` again, at most ``max_rounds`` times ``len(rows)``."""
        ex, workflow = self._executor, self._whole(workflow, granularity)
        return self._collect(
            "rollout_batch",
            lambda: ex.rollout_batch(rows, workflow, should_accept_fn, timeout, max_rounds, refill),
            granularity,
        )

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: RolloutWorkflow,
        should_accept_fn: ShouldAcceptFn | None = None,
        granularity: int = 1,
        timeout: float | None = None,
        max_rounds: int | None = None,
    ) -> TensorDict:
        """Asynchronous rollout (bounded staleness), then DP redistribution (groups kept whole; episodes of
        another size than ``granularity`` drop their group, as in :meth:`rollout_batch`); ``max_rounds`` bounds
        the rejections as there."""
        ex, workflow = self._executor, self._whole(workflow, granularity)
        return self._collect(
            "prepare_batch",
            lambda: ex.prepare_batch(dataloader, workflow, should_accept_fn, timeout, max_rounds),
            granularity,
        )

    def eval_batch(
        self, rows: list[dict[str, Any]], workflow: RolloutWorkflow, timeout: float | None = None
    ) -> TensorDict:
        """Trajectories of this replica's ``rows`` from the evaluation executor; no DP redistribution."""
        ex = self._eval_executor
        if ex is None:
            raise RuntimeError(
                "RolloutController.eval_batch(): built without eval_stats_name, so no evaluation executor"
            )
        return self._collect("eval_batch", lambda: ex.rollout_batch(rows, workflow, None, timeout), None)

    # ------------------------------------------------------------------ pause / weights
    def pause(self) -> None:
        """Stop starting training episodes (running ones continue); the servers keep serving."""
        self._executor.pause()

    def resume(self) -> None:
        self._executor.resume()

    def push_weights(
        self, version: int | None = None, meta: WeightUpdateMeta | None = None, restored: bool = False
    ) -> int:
        """Collective: install the engine's weights on every server as ``version``; returns it.

        ``version`` defaults to ``meta.version``, else the engine's version + 1; ``meta`` to the
        controller's. Episodes stop starting during the push; afterwards the engine, the client
        and the executors are at ``version``. ``restored``: the weights come from a checkpoint
        resumed at ``version``, so rollout capacity is counted from it.
        """
        self._require_live("push_weights")
        meta = meta or self.meta
        if meta is None:
            raise ValueError("push_weights: no WeightUpdateMeta (pass one here or to RolloutController)")
        if version is None:
            version = meta.version if meta.version is not None else self.engine.get_version() + 1
        if self.deterministic:  # no rank's rollout may be cut by the servers' pause
            self._executor.drain()
            dist.barrier()
        self.pause()
        try:
            self._pusher.push(meta.with_version(version))
            self.engine.set_version(version)
            if restored:
                self._executor.staleness.set_base_version(version)
            for executor in self._executors():
                executor.set_version(version)  # the client's version; wakes the launch loop
        finally:
            self.resume()
        return version

    # ------------------------------------------------------------------ recovery / stats
    @property
    def last_batch_rows(self) -> list[dict[str, Any]]:
        """The rows behind the last training batch this rank's executor handed out."""
        return self._executor.last_batch_rows

    def pending_rows(self) -> list[dict[str, Any]]:
        """Rows taken from the dataloader whose trajectories no batch has handed out (see ``WorkflowExecutor``)."""
        return self._executor.pending_rows()

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None:
        """Generate ``rows`` (a checkpoint's ``pending_rows``) before new dataloader rows."""
        self._executor.replay_first(rows)

    @property
    def last_push_stats(self) -> SyncStats | None:
        """Rank 0's figures of the last weight push (bytes moved, seconds; None before the first, or on other ranks)."""
        return self._pusher.last_stats

    @property
    def ledger(self) -> Ledger:
        """This rank's sample ledger of training rollouts (``tandemrl.rollout.ledger``)."""
        return self._executor.ledger

    def ledger_totals(self) -> LedgerTotals:
        """This rank's ledger, with the samples in flight measured at the same moment."""
        return self._executor.ledger_totals()

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(pending rows, ledger state) at one moment, for a recoverable checkpoint."""
        return self._executor.recover_state()

    def restore_ledger(self, state: dict[str, Any]) -> Tally:
        """Continue a checkpoint's ledger; its samples in flight become ``lost_at_restart`` (returned)."""
        return self._executor.restore_ledger(state)

    def export_stats(self, reduce_group: Any = None) -> dict[str, float]:
        """Rollout statistics of every executor (training, then evaluation), reduced over ``reduce_group``.

        Includes ``<stats_name>/timeperf/server_busy``: seconds since the last call during which
        this rank had a generate request in flight (mean over ranks), for the servers' idle share; and
        ``<stats_name>/resubmitted_tokens``: tokens the servers had to prefill again because a weight update
        aborted requests in flight (mean over ranks; none from updates with ``pause_mode`` "keep").
        """
        stats_tracker.get(self.config.stats_name).scalar(
            **{
                "timeperf/server_busy": self.client.take_busy_seconds(),
                "resubmitted_tokens": float(self.client.take_resubmitted_tokens()),
            }
        )
        stats: dict[str, float] = {}
        for executor in self._executors():
            stats.update(executor.export_stats(reduce_group=reduce_group))
        return stats

    def destroy(self) -> None:
        """Stop the executors and close the weight-update group (rank 0 hosts its store and port).

        Idempotent. The client stays the caller's to destroy.
        """
        self._destroyed = True
        for executor in self._executors():
            executor.destroy()
        self._pusher.close()
