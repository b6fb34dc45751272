"""The supervised fine-tuning loop: :class:`SFTTrainer`, beside :class:`~tandemrl.trainers.rl_loop.RLTrainer`.

A script is the config and two lines (``examples/gsm8k_sft.py``)::

    config, _ = load_config_or_exit(argv, SFTConfig)
    with SFTTrainer(config) as trainer:
        trainer.train()

It builds the model's engine (backend from ``allocation_mode``), tokenizer, dataloaders, saver,
evaluator, recover handler and logger as RL does (``tandemrl.trainers.base``); the algorithm is
``SFTActor`` (next-token loss on ``loss_mask`` tokens). Each step: one ``train_lm`` update (the engine
advances its LR schedule) -> HF save -> evaluation (``eval_loss`` on the validation set) -> log ->
recoverable checkpoint. A run restarted with ``recover.mode`` auto/resume and a checkpoint present
continues after its step (weights, optimizer, LR schedule, dataloader position, counters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from tqdm import tqdm

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.renamed import RenamedAttribute
from tandemrl.configs import SFTConfig
from tandemrl.data.loader import cycle_batches, pad_sequences_to_tensors
from tandemrl.trainers.base import TrainerBase
from tandemrl.trainers.saver import final_outputs_line
from tandemrl.utils import stats_tracker


class SFTTrainer(TrainerBase[SFTConfig]):
    """An SFT run from an SFTConfig; ``actor_engine`` is the model's TrainBackend, ``actor`` the algorithm on it
    (``SFTActor``), as in an RL script."""

    if not TYPE_CHECKING:  # the old names fail with the line naming the new one (tandemrl.api.renamed)
        engine = RenamedAttribute("actor_engine")
        sft = RenamedAttribute("actor")

    def __init__(self, config: SFTConfig, name: str = "sft") -> None:
        alloc = config.allocation
        if alloc.train is None:
            raise ValueError(f"allocation_mode: '{config.allocation_mode}' has no training component")
        self.config, self.alloc, self.name = config, alloc, name
        self.actor_engine = self._build_engine_and_data(config.model, "model.path")
        self.actor = SFTActor(self.actor_engine)
        self._build_bookkeeping()
        self._save_config()
        self.pad_id = self.tokenizer.pad_token_id

    def evaluate(self) -> None:
        """The token-weighted loss over the whole validation set, recorded as ``eval_loss``."""
        assert self.valid_dl is not None
        total, n = 0.0, 0
        for rows in self.valid_dl:
            total += self.actor.evaluate_lm(pad_sequences_to_tensors(rows, self.pad_id))
            n += 1
        stats_tracker.scalar(eval_loss=total / max(n, 1))

    def _resume(self) -> int:
        """Restore a recoverable checkpoint if ``recover.mode`` asks for it; the first step to run."""
        state = self.recover.load()
        return 0 if state is None else state.global_step + 1

    def train(self) -> None:
        """``total_train_steps`` steps of update -> save -> evaluate -> recoverable checkpoint -> log, then the
        closing lines (rank 0)."""
        engine, spec = self.actor_engine, self.ft_spec
        first_step = self._resume()
        batches = cycle_batches(self.train_dl, "train_dataset")
        total_steps = spec.total_train_steps
        bar = tqdm(total=total_steps, initial=first_step, desc=self.name, disable=dist.get_rank() != 0)
        for global_step in range(first_step, total_steps):
            epoch, step = divmod(global_step, spec.steps_per_epoch)
            last = global_step == total_steps - 1
            batch = pad_sequences_to_tensors(next(batches), self.pad_id)
            with stats_tracker.record_timing("train_step"):
                stats = self.actor.train_lm(batch)
            self._end_step(epoch, step, global_step, last, self.evaluate)
            self.logger.commit(epoch, step, global_step, engine.export_stats())
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.4f}")
        bar.close()
        self.logger.close()  # its curves' path printed before the closing lines
        if dist.get_rank() == 0:
            print(
                f"{self.name} done: {total_steps - first_step} steps; logs in {self.logger.log_dir}; "
                f"checkpoints under {self._checkpoint_root()}"
            )
            print(final_outputs_line(self.name, self.saver.last_path, self.recover), flush=True)
