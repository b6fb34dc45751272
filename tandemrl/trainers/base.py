"""What every trainer builds the same way, and how it ends.

:class:`TrainerBase` holds the wiring :class:`~tandemrl.trainers.sft.SFTTrainer` and
:class:`~tandemrl.trainers.rl_loop.RLTrainer` share: the model path resolved, its engine from the
registry row of the backend named in ``allocation_mode`` (process group joined), the tokenizer, the
train/validation dataloaders and the ``FinetuneSpec`` that sizes the run (and the engine's LR
schedule), then the saver, evaluator, recover handler and stats logger; ``close`` releases them. A
trainer is a context manager: leaving the ``with`` block normally closes it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import torch.distributed as dist

from tandemrl.api.allocation import AllocationMode
from tandemrl.api.engine import TrainBackend
from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.experiment import BaseExperimentConfig
from tandemrl.configs.loader import save_config
from tandemrl.data.loader import create_dataloader, dataset_from_config
from tandemrl.engines.registry import make_engine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.hf import load_hf_tokenizer, model_context_length
from tandemrl.models.resolve import resolve_model_path
from tandemrl.trainers.evaluator import Evaluator
from tandemrl.trainers.recover import RecoverHandler, RecoverStates
from tandemrl.trainers.saver import Saver
from tandemrl.trainers.stats_logger import StatsLogger
from tandemrl.utils import stats_tracker

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

C = TypeVar("C", bound=BaseExperimentConfig)


class TrainerBase(Generic[C]):
    """The shared parts; a trainer calls :meth:`_build_engine_and_data`, then :meth:`_build_bookkeeping`."""

    config: C
    alloc: AllocationMode
    tokenizer: Any
    train_dl: StatefulDataLoader
    valid_dl: StatefulDataLoader | None
    ft_spec: FinetuneSpec
    _main_engine: TrainBackend  # the trained model's engine, destroyed last
    _extra_engines: list[TrainBackend]  # more engines on the training ranks (RL: reference, critic)

    def _build_engine_and_data(self, model: TrainEngineConfig, key: str) -> TrainBackend:
        """The engine of ``model`` (its path resolved and named ``key`` in errors) on the allocation's training
        ranks; sets ``tokenizer``, ``train_dl``, ``valid_dl`` (None without a validation set) and ``ft_spec``,
        then initializes the engine (its LR schedule spans ``ft_spec.total_train_steps``)."""
        config, alloc = self.config, self.alloc
        assert alloc.train is not None
        model.path = resolve_model_path(model.path, key, corpus_path=config.train_dataset.path)
        engine = make_engine(alloc.train.backend, model)  # the backend named in allocation_mode
        engine.create_process_group(alloc.train.strategy)
        rank, world = engine.data_parallel_rank, engine.data_parallel_world_size
        self.tokenizer = load_hf_tokenizer(config.tokenizer_path or model.path)

        context = model_context_length(model.path)
        train_ds = dataset_from_config(config.train_dataset, self.tokenizer, rank, world, context)
        self.train_dl = create_dataloader(train_ds, config.train_dataset, rank, world, seed=config.seed)
        self.valid_dl = None
        if config.valid_dataset is not None:
            valid_ds = dataset_from_config(config.valid_dataset, self.tokenizer, rank, world, context)
            self.valid_dl = create_dataloader(valid_ds, config.valid_dataset, rank, world, seed=config.seed)
        self.ft_spec = FinetuneSpec(
            total_train_epochs=config.total_train_epochs,
            dataset_size=len(train_ds) * world,
            train_batch_size=config.train_dataset.batch_size,
            total_train_steps_override=config.total_train_steps,
        )
        engine.initialize(None, self.ft_spec)
        self._main_engine = engine
        self._extra_engines = []
        return engine

    def _build_bookkeeping(self) -> None:
        """``saver`` (HF exports), ``evaluator``, ``recover`` (recoverable checkpoints of
        :meth:`_recover_states`) and ``logger``; called once the engines (and an RL trainer's rollout) exist."""
        config = self.config
        self.saver = Saver(config.saver, self.ft_spec)
        self.evaluator = Evaluator(config.evaluator, self.ft_spec)
        self.recover = RecoverHandler(config.recover, self.ft_spec, self._recover_states())
        self.logger = StatsLogger(config.stats_logger, self.ft_spec)

    def _recover_states(self) -> RecoverStates:
        """What a recoverable checkpoint holds: the trained engine, the dataloader position, the save and
        evaluation schedules (an RL trainer adds its critic and its rollout)."""
        engine = self._main_engine
        return RecoverStates({"model": engine}, engine, self.train_dl, self.saver, self.evaluator)

    def _end_step(
        self, epoch: int, step: int, global_step: int, last: bool, evaluate: Callable[[], Any] | None
    ) -> None:
        """The end of every step (RL: after its weight push): HF save, evaluation (``evaluate``, when there is a
        validation set), recoverable checkpoint; each when due, or on the ``last`` step."""
        with stats_tracker.record_timing("save"):
            saved = self.saver.save(self._main_engine, epoch, step, global_step, tokenizer=self.tokenizer, last=last)
        if evaluate is not None and self.valid_dl is not None:
            with stats_tracker.record_timing("eval"):
                self.evaluator.evaluate(evaluate, epoch, step, global_step)
        with stats_tracker.record_timing("recover"):
            self.recover.dump(step, global_step, last=last, final_model=self.saver.last_path if saved else None)

    def _save_config(self) -> None:
        """Rank 0 writes the run's resolved config next to its logs."""
        if dist.get_rank() == 0:
            save_config(self.config, f"{self.logger.log_dir}/config.yaml")

    def _checkpoint_root(self) -> str:
        cfg = self.config.saver
        return self.saver.get_save_root(cfg.fileroot, cfg.experiment_name, cfg.trial_name)

    def _close_services(self) -> None:
        """What a trainer runs besides its engines (RL: rollout, inference client); stopped before them."""

    def close(self) -> None:
        """Flush the logs, stop the services, release every engine (extra ones first), then the process groups."""
        self.logger.close()
        self._close_services()
        for engine in self._extra_engines:
            engine.destroy()
        self._main_engine.destroy()
        destroy_process_groups()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Closes after a normal exit only. On an error the process is ending, and the teardown's collectives
        (barriers over every group) would wait for ranks that may have died with it."""
        if exc_type is None:
            self.close()
