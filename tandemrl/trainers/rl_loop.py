"""The RL loop every example shares; the algorithm plugs in as a ``train_step`` callback.

An RL script builds an :class:`RLTrainer` (engines, data, rollout client and controller, saver,
evaluator, logger), picks its workflows and extra engines (reference, critic), and
hands :meth:`RLTrainer.run` a function that turns one rollout batch into updates::

    trainer = RLTrainer(config, name="grpo")  # builds the actor's engine: trainer.actor_engine
    actor = PPOActor(config.actor, trainer.actor_engine)  # the algorithm, composed with that engine
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(workflow, ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()

Engines come from ``tandemrl.engines.registry`` (one row per backend); algorithms from
``tandemrl.algorithms`` take an engine, so any algorithm runs on any backend. Steps provided
here: :func:`ppo_train_step` (PPO family, optionally with reference and critic) and
:func:`reinforce_train_step` (ReMax). Each step of the loop, through the
:class:`~tandemrl.rollout.controller.RolloutController`: rollout (``prepare_batch`` when
async: ``async_training``, or null with a staleness bound > 0; else ``rollout_batch``) ->
``train_step(batch, global_step)`` (with the servers asleep when colocated: ``tandemrl.trainers.turns``) ->
``push_weights`` -> save -> evaluate -> recoverable checkpoint (``recover.mode`` auto/resume, every
``recover.freq_*``) -> log. Each phase is timed under ``timeperf/`` (``rollout_wait``: the trainer idle,
waiting for its batch; ``actor/recompute_logp``, ``ref_logp``, ``.../fwd_bwd``, ``.../optimizer_step``,
``update_weights``, ``save``, ``eval``, ``recover``, ``step``); the run ends with a one-line split of its
steps' time (``tandemrl.trainers.time_split``). Each step checks the sample ledger over all ranks (every generated
sample consumed, discarded by reason or in flight; ``tandemrl.rollout.ledger``, docs/ledger.md) and logs it under
``ledger/``; a closing line gives its totals. A run restarted with a checkpoint present restores the engines, the
dataloader position, the rows still in flight (generated again first) and the counters, pushes the restored weights to the servers (labelled
with the restored version) and continues at the next step; see ``tandemrl.trainers.recover``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from tqdm import tqdm

from tandemrl.algorithms.filters import reject_uniform_rewards
from tandemrl.algorithms.ppo import PPOActor, PPOBatch, PPOCritic
from tandemrl.algorithms.reinforce import ReinforceActor
from tandemrl.api.allocation import AllocationMode
from tandemrl.api.engine import TrainBackend
from tandemrl.api.inference import WeightUpdateMeta
from tandemrl.api.renamed import RenamedAttribute
from tandemrl.api.types import RolloutBatch, TensorDict
from tandemrl.api.workflow import RolloutWorkflow
from tandemrl.configs import GRPOConfig
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.experiment import async_enabled
from tandemrl.data.loader import cycle_batches
from tandemrl.engines.registry import make_engine
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.models.resolve import resolve_model_path
from tandemrl.rewards.runner import RewardFn
from tandemrl.rollout.controller import RolloutController
from tandemrl.rollout.ledger import LedgerTotals, Tally
from tandemrl.trainers.base import TrainerBase
from tandemrl.trainers.heldout import HeldoutEval
from tandemrl.trainers.pipeline_metrics import pipeline_shares, record_staleness
from tandemrl.trainers.prompt_log import log_prompt_ids
from tandemrl.trainers.recover import RecoverStates
from tandemrl.trainers.refill import RefillRows, RunRows
from tandemrl.trainers.saver import final_outputs_line
from tandemrl.trainers.signal import SignalWatch
from tandemrl.trainers.time_split import add_step_timings, format_time_split
from tandemrl.trainers.turns import TurnTaker
from tandemrl.utils import stats_tracker
from tandemrl.weights.plan import collective_update
from tandemrl.workflows.rlvr import RLVRWorkflow

# train_step(batch, global_step): compute whatever the algorithm needs and update the engines. A step
# whose update leaves some rows out of the loss names them with an attribute ``untrained_rows(batch) ->
# bool [B]`` (ppo_train_step with mask_no_eos); the sample ledger counts those rows ``too_long``.
TrainStep = Callable[[TensorDict, int], None]
# Evaluation rollouts record their statistics under this tracker (the eval workflow's scope too).
EVAL_STATS = "eval-rollout"


def weight_update_meta(config: GRPOConfig, alloc: AllocationMode) -> WeightUpdateMeta:
    """Rank 0 picks the rendezvous address/port; every rank gets the same meta."""
    if config.weight_update_mode == "disk":
        for key in ("weight_update_delta", "weight_update_dtype"):
            if getattr(config, key) not in (None, "none"):
                raise ValueError(f"{key}={getattr(config, key)!r} needs weight_update_mode=collective (got disk)")
        meta = WeightUpdateMeta.from_disk(config.cluster.fileroot, config.experiment_name, config.trial_name)
    else:
        meta = collective_update(
            alloc,
            group_addr="127.0.0.1" if config.cluster.n_nodes == 1 else None,
            delta=cast(Any, config.weight_update_delta),
            anchor_every=config.weight_update_anchor_every,
            dtype=config.weight_update_dtype,
        )
    box = [meta]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ppo_train_step(actor: PPOActor, ref: PPOActor | None = None, critic: PPOCritic | None = None) -> TrainStep:
    """The PPO-family step (GRPO, DAPO, RLOO, ..., PPO with ``critic``): logp, values, advantages, updates."""
    config = actor.config

    def step(rollout: TensorDict, global_step: int) -> None:
        batch = cast(PPOBatch, rollout)
        with stats_tracker.scope("actor"):  # recomputed only when needed (recompute_logprob)
            prox = actor.proximal_logp(batch)
        if prox is not None:
            batch["prox_logp"] = prox
        if ref is not None and config.kl_ctl > 0:  # the reference forward serves the KL term only
            with stats_tracker.record_timing("ref_logp"):
                batch["ref_logp"] = ref.compute_logp(batch)
        if critic is not None:
            with stats_tracker.record_timing("compute_values"):
                batch["values"] = critic.compute_values(batch)
        with stats_tracker.record_timing("train_step"), stats_tracker.scope("actor"):
            batch = actor.compute_advantages(batch)
            actor.ppo_update(batch)
        if critic is not None:
            with stats_tracker.record_timing("critic_train_step"), stats_tracker.scope("critic"):
                critic.ppo_update(batch)

    if config.mask_no_eos:
        step.untrained_rows = actor.truncated_rows  # type: ignore[attr-defined]
    return step


def reinforce_train_step(actor: ReinforceActor) -> TrainStep:
    """The REINFORCE step (ReMax with ``ReMaxRLVRWorkflow``): one update on the workflow's rewards as advantages."""

    def step(batch: TensorDict, global_step: int) -> None:
        with stats_tracker.record_timing("train_step"), stats_tracker.scope("actor"):
            actor.train_reinforce(cast(RolloutBatch, batch))

    return step


@dataclass
class RunSummary:
    """What a run did, for the closing line and for callers that report on it."""

    steps: int = 0
    seconds: float = 0.0
    n_samples: int = 0
    n_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (global step, greedy accuracy)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # time_split label -> seconds, ranks' mean
    ledger: LedgerTotals | None = None  # the sample ledger at the end, summed over trainer ranks


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class RLTrainer(TrainerBase[GRPOConfig]):
    """Builds the pieces of an RL run from a GRPOConfig (or subclass) and runs the shared loop.

    ``actor_engine`` is the policy's TrainBackend (backend from ``allocation_mode``); the script composes
    its algorithm with it, e.g. ``PPOActor(config.actor, trainer.actor_engine)``. The engine, data, saver,
    evaluator, recover handler and logger are built as for SFT (``tandemrl.trainers.base``).
    """

    if not TYPE_CHECKING:  # the old name fails with the line naming the new one (tandemrl.api.renamed)
        actor = RenamedAttribute("actor_engine")

    def __init__(self, config: GRPOConfig, name: str = "grpo") -> None:
        alloc = config.allocation
        if alloc.train is None or alloc.gen is None:
            raise ValueError(f"allocation_mode: '{config.allocation_mode}' needs an inference and a training component")
        self.config, self.alloc, self.name = config, alloc, name
        self.actor_engine = self._build_engine_and_data(config.actor.engine, "actor.engine.path")
        self._reward_service: Any = None  # a RemoteReward, closed with the trainer

        # Each trainer rank runs its own client; servers come from the launcher's environment.
        self.client = RemoteInferenceClient.for_backend(alloc.gen.backend, config.rollout)
        self.client.initialize()
        self.meta = weight_update_meta(config, alloc)
        eval_stats = EVAL_STATS if self.valid_dl is not None else None
        # One step consumes this rank's share of a dataloader batch.
        self.rollout = RolloutController(
            self.client,
            self.actor_engine,
            config.rollout,
            self.meta,
            eval_stats_name=eval_stats,
            consumer_batch_size=config.train_dataset.batch_size // self.actor_engine.data_parallel_world_size,
            deterministic=config.deterministic,
        )
        stop = sorted({*config.gconfig.stop_token_ids, self.tokenizer.eos_token_id})
        self.gconfig = config.gconfig.new(stop_token_ids=stop)

        self._named_engines: dict[str, TrainBackend] = {"actor": self.actor_engine}  # add_engine adds more
        self._build_bookkeeping()
        self.heldout = HeldoutEval(config.heldout_eval, self.tokenizer)
        # Colocated ('|'): the servers sleep during each train_step (turns.py); async is refused at load.
        self.turns = TurnTaker(self.client, alloc.colocated(alloc.gen, alloc.train), self.logger.log_dir)
        self._save_config()
        self.summary = RunSummary()
        self.signal = SignalWatch(config.warn_no_signal_steps)

    # ------------------------------------------------------------------ parts
    def add_engine(self, engine_config: TrainEngineConfig, key: str) -> TrainBackend:
        """Another engine on the training ranks (reference, critic) from the config at ``key``.

        Its path defaults to the actor's; e.g. ``PPOCritic(config.critic, trainer.add_engine(config.critic.engine,
        "critic.engine"))``.
        """
        actor_path = self.config.actor.engine.path
        engine_config.path = resolve_model_path(engine_config.path or actor_path, f"{key}.path")
        train = self.alloc.train
        assert train is not None  # __init__ refuses an allocation without one
        engine = make_engine(train.backend, engine_config)
        engine.create_process_group(train.strategy)
        engine.initialize(None, self.ft_spec)
        self._extra_engines.append(engine)
        self._named_engines[key.split(".")[0]] = engine
        return engine

    def reference(self) -> PPOActor | None:
        """The frozen reference policy when the KL term is on (``actor.kl_ctl > 0`` and ``ref`` set), else None.

        It computes ``ref_logp`` with the actor's algorithm settings (temperature) on the ``ref`` model,
        over the full vocabulary (no truncation replay: the KL is to the untruncated reference).
        """
        if self.config.actor.kl_ctl > 0 and self.config.ref is not None:
            settings = replace(self.config.actor, truncation_replay=False)
            return PPOActor(settings, self.add_engine(self.config.ref, "ref"))
        return None

    def rlvr_workflows(
        self, reward_fn: RewardFn, workflow_cls: type[RLVRWorkflow] = RLVRWorkflow, **kwargs: Any
    ) -> tuple[RLVRWorkflow, RLVRWorkflow]:
        """(training workflow, greedy single-sample evaluation workflow) scoring with ``reward_fn``.

        With ``deterministic`` the training workflow seeds every request from the run's ``seed``. With
        ``reward_service.url`` or ``.judge`` set, training rewards come from that service
        (``tandemrl.inference.reward_service``); evaluation keeps ``reward_fn``.
        """
        if self.config.deterministic:
            kwargs.setdefault("seed", self.config.seed)
        train_reward: RewardFn = reward_fn
        if self.config.reward_service.enabled:
            from tandemrl.inference.reward_service import RemoteReward

            train_reward = self._reward_service = RemoteReward(self.config.reward_service)
        workflow = workflow_cls(train_reward, self.gconfig, self.tokenizer, **kwargs)
        eval_gconfig = self.gconfig.new(greedy=True, n_samples=1)
        return workflow, RLVRWorkflow(reward_fn, eval_gconfig, self.tokenizer, stat_scope=EVAL_STATS)

    def _dp_sum(self, values: list[float], group: Any = None) -> list[float]:
        """Sums over the data-parallel ranks (over ``group`` if given)."""
        group = self.actor_engine.data_parallel_group if group is None else group
        device = self.actor_engine.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    def evaluate(self, eval_workflow: RolloutWorkflow, global_step: int | None = None) -> float | None:
        """Mean reward of ``eval_workflow`` over the whole validation set (all DP ranks); None without one.

        With the greedy 0/1-reward workflow of :meth:`rlvr_workflows` this is the accuracy.
        """
        if self.valid_dl is None:
            return None
        total, count = 0.0, 0
        for rows in self.valid_dl:
            batch = self.rollout.eval_batch(rows, eval_workflow)
            total += float(batch["rewards"].float().sum())
            count += int(batch["rewards"].numel())
        total, n_rows = self._dp_sum([total, float(count)])
        accuracy = total / max(n_rows, 1.0)
        stats_tracker.get(EVAL_STATS).scalar(accuracy=accuracy)
        step = self.actor_engine.get_version() if global_step is None else global_step
        self.summary.evals.append((step, accuracy))
        return accuracy

    # ------------------------------------------------------------------ recovery
    def _recover_states(self) -> RecoverStates:
        """Every engine, as ``add_engine`` adds them (those that train: actor, critic; a frozen reference is
        rebuilt from its path), the actor's weights as pushed, and the rollout's pending rows and ledger."""
        engines, actor = self._named_engines, self.actor_engine
        self._rows = RunRows(self.rollout)  # the rollout's pending rows and a synchronous refill's (refill.py)
        return RecoverStates(engines, actor, self.train_dl, self.saver, self.evaluator, rollout=self._rows)

    def _refill(self, data_iter: Iterator[list[dict[str, Any]]], wanted: bool) -> RefillRows | None:
        """The rows that replace a synchronous step's rejected groups (new prompts, as DAPO draws them), if
        ``wanted``; a checkpoint's rows not yet trained go first: to the refill, else to the rollout."""
        replayed, self._rows.replayed = self._rows.replayed, []
        if wanted:
            self._rows.refill = RefillRows(data_iter, replayed)
            return self._rows.refill
        if replayed:
            self.rollout.replay_first(replayed)  # asynchronous: prepare_batch submits them before new rows
        return None

    def _maybe_resume(self) -> int:
        """Restore a recoverable checkpoint if ``recover.mode`` asks for it; the first step to run."""
        state = self.recover.load()
        if state is None:
            if self.config.rollout.server_addrs:
                # Running servers (rollout.server_addrs) may hold any weights: install ours as version 0
                # before the first rollout.
                self.rollout.push_weights(0, restored=True)
            return 0
        # The servers started from the initial model: give them the restored weights, labelled with
        # the restored version, before any rollout; rollout capacity counts from that version.
        self.rollout.push_weights(state.version, restored=True)
        return state.global_step + 1

    # ------------------------------------------------------------------ loop

    def run(
        self,
        workflow: RolloutWorkflow,
        train_step: TrainStep,
        eval_workflow: RolloutWorkflow | None = None,
        should_accept_fn: Callable[[TensorDict], bool] | None = None,
    ) -> RunSummary:
        """``total_train_steps`` steps of rollout -> train_step -> weight update -> save/eval/log.

        ``should_accept_fn(trajectory) -> bool`` drops whole rollout groups before they reach
        the batch (DAPO's dynamic sampling: ``tandemrl.algorithms.filters.reject_uniform_rewards``).
        """
        config, actor, rollout, summary = self.config, self.actor_engine, self.rollout, self.summary
        group = config.actor.group_size
        if should_accept_fn is None and getattr(config.actor, "dynamic_sampling", False):
            should_accept_fn = reject_uniform_rewards
        world = actor.data_parallel_world_size
        first_step = self._maybe_resume()
        if first_step == 0:
            self.heldout.score(self.client, "before", actor.get_version())
        data_iter = cycle_batches(self.train_dl, "rollout_batch")
        refill = self._refill(data_iter, should_accept_fn is not None and not async_enabled(config))
        total_steps = self.ft_spec.total_train_steps
        spe = self.ft_spec.steps_per_epoch
        bar = tqdm(total=total_steps, initial=first_step, desc=self.name, disable=dist.get_rank() != 0)
        start = time.monotonic()
        for global_step in range(first_step, total_steps):
            epoch, step = divmod(global_step, spe)
            last = global_step == total_steps - 1
            step_start = time.perf_counter()
            # The trainer idles here: the whole generation when sync, what training did not overlap when async.
            with stats_tracker.record_timing("rollout_wait"):
                if async_enabled(config):
                    batch = rollout.prepare_batch(
                        self.train_dl,
                        workflow,
                        should_accept_fn=should_accept_fn,
                        granularity=group,
                        max_rounds=getattr(config.actor, "dynamic_sampling_rounds", 8),
                    )
                else:
                    batch = rollout.rollout_batch(
                        next(data_iter),
                        workflow,
                        should_accept_fn=should_accept_fn,
                        granularity=group,
                        refill=refill,
                        max_rounds=getattr(config.actor, "dynamic_sampling_rounds", 8),
                    )
            self._count_untrained(batch, train_step)
            summary.n_samples += batch["attention_mask"].shape[0] * world
            summary.n_tokens += int(batch["loss_mask"].sum()) * world
            gen = batch["versions"][batch["loss_mask"].bool()]
            # Weight versions that produced this batch's tokens (the server labels each token).
            stats_tracker.scalar(rollout_version_min=gen.min(), rollout_version_max=gen.max())
            record_staleness(batch["versions"], batch["loss_mask"], actor.get_version())
            with self.turns.trainer_turn():
                train_step(batch, global_step)
            with stats_tracker.record_timing("update_weights"):
                rollout.push_weights(global_step + 1)
            evaluate = functools.partial(self.evaluate, eval_workflow, global_step + 1) if eval_workflow else None
            self._end_step(epoch, step, global_step, last, evaluate)
            stats_tracker.scalar(**{"timeperf/step": time.perf_counter() - step_start})
            self._commit(epoch, step, global_step)
            if config.stats_logger.prompt_ids:
                log_prompt_ids(self.logger.log_dir, global_step, rollout.last_batch_rows, rollout.pending_rows())
            bar.update(1)
            reward = summary.rewards[-1] if summary.rewards else None
            if reward is not None:
                bar.set_postfix(reward=f"{reward:.3f}")
        bar.close()
        summary.steps += max(0, total_steps - first_step)
        summary.seconds += time.monotonic() - start
        if self.heldout.enabled:
            rollout.pause()  # no new training episodes compete with the held-out requests
            self.heldout.score(self.client, "after", actor.get_version())
        summary.ledger = self._ledger()
        self._print_summary()
        return summary

    def _count_untrained(self, batch: TensorDict, train_step: TrainStep) -> None:
        """Ledger: the rows of this rank's batch that the update leaves out of the loss become ``too_long``.

        Only DP heads count: the batch a head hands its model-parallel peers is the same rows.
        """
        untrained = getattr(train_step, "untrained_rows", None)
        if untrained is None or not self.actor_engine.is_data_parallel_head():
            return
        rows = untrained(batch).bool().cpu()
        if bool(rows.any()):
            tokens = int(batch["loss_mask"].cpu()[rows].sum())
            self.rollout.ledger.unconsume("too_long", Tally(int(rows.sum()), tokens))

    def _ledger(self) -> LedgerTotals:
        """Collective: the sample ledger summed over every trainer rank, checked (one-line LedgerError if it
        does not balance). Ranks that are not DP heads generate nothing and add zeros."""
        local = self.rollout.ledger_totals()
        totals = LedgerTotals.from_vector(self._dp_sum(local.to_vector(), group=dist.group.WORLD))
        totals.check()
        return totals

    def _commit(self, epoch: int, step: int, global_step: int) -> None:
        stats_tracker.scalar(**self._ledger().stats())  # the run's totals so far; a violation fails the step
        # Rollout trackers first (reduced over DP ranks), then everything the trainer recorded.
        dp_group = self.actor_engine.data_parallel_group
        stats = self.rollout.export_stats(reduce_group=dp_group)
        stats.update(self.actor_engine.export_stats())
        stats.update(pipeline_shares(stats, self.actor_engine.data_parallel_world_size))
        self.logger.commit(epoch, step, global_step, stats)
        add_step_timings(self.summary.phase_seconds, stats, self.actor_engine.data_parallel_world_size)
        reward = stats.get("rollout/reward")
        if reward is not None:
            self.summary.rewards.append(reward)
        warning = self.signal.observe(stats)
        if warning is not None and dist.get_rank() == 0:
            print(f"{self.name} {warning}", flush=True)

    def _print_summary(self) -> None:
        if dist.get_rank() != 0:
            return
        s, root = self.summary, self._checkpoint_root()
        secs = max(s.seconds, 1e-9)
        k = max(1, len(s.rewards) // 4)
        head, tail = s.rewards[:k] or [0.0], s.rewards[-k:] or [0.0]
        print(
            f"{self.name} done: {s.steps} steps in {secs:.0f} s; reward {_mean(head):.3f} (first steps) -> "
            f"{_mean(tail):.3f} (last steps); throughput {s.n_samples / secs:.2f} samples/s, "
            f"{s.n_tokens / secs:.0f} generated tokens/s; logs in {self.logger.log_dir}; checkpoints under {root}"
            + (f"; {self.signal.closing()}" if self.signal.closing() else ""),
            flush=True,
        )
        print(f"{self.name} {format_time_split(s.phase_seconds)}", flush=True)
        if s.ledger is not None:
            print(f"{self.name} {s.ledger.line()}", flush=True)
        heldout = self.heldout.report()
        if heldout is not None:
            print(f"{self.name} {heldout}", flush=True)
        self.logger.draw_curves()  # its path printed before the run's last line, the final model's
        print(final_outputs_line(self.name, self.saver.last_path, self.recover), flush=True)

    def _close_services(self) -> None:
        """Stop rollout (its weight-update group too), the client and the reward service (before the engines)."""
        self.rollout.destroy()
        self.client.destroy()
        if self._reward_service is not None:
            self._reward_service.close()
