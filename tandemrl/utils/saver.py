"""Periodic HF-format checkpoints that inference servers and transformers can reload."""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch.distributed as dist

from tandemrl.configs.utils import SaverConfig
from tandemrl.engines.types import FinetuneSpec, SaveLoadMeta
from tandemrl.utils.freq import FreqControl, agree_with_rank0, epochs_finished


class SupportsSave(Protocol):
    """Any training engine: ``save`` is collective over the engine's ranks."""

    def save(self, meta: SaveLoadMeta) -> None: ...


class Saver:
    """Decides when to save and where; call ``save`` on every rank after every step."""

    def __init__(self, config: SaverConfig, ft_spec: FinetuneSpec | None) -> None:
        if config.freq_epochs is not None and ft_spec is None:
            raise ValueError("Saver: freq_epochs is set but no FinetuneSpec was given to locate epoch ends")
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = FreqControl.from_config(config)

    @staticmethod
    def get_save_root(fileroot: str, experiment_name: str, trial_name: str) -> str:
        return os.path.join(fileroot, "checkpoints", experiment_name, trial_name)

    @staticmethod
    def get_save_path(
        fileroot: str, experiment_name: str, trial_name: str, epoch: int, step: int, global_step: int
    ) -> str:
        """Directory of one checkpoint: ``<root>/checkpoints/<exp>/<trial>/epoch{E}epochstep{S}globalstep{G}``."""
        name = f"epoch{epoch}epochstep{step}globalstep{global_step}"
        return os.path.join(Saver.get_save_root(fileroot, experiment_name, trial_name), name)

    def _due(self, step: int, force: bool) -> bool:
        due = self.freq_ctl.check(epochs=epochs_finished(step, self.ft_spec), steps=1)
        if self.freq_ctl.freq_secs is not None:
            due = agree_with_rank0(due)
        if force and not due:
            self.freq_ctl.reset()
        return due or force

    def save(
        self,
        engine: SupportsSave,
        epoch: int,
        step: int,
        global_step: int,
        tokenizer: str | Any | None = None,
        force: bool = False,
    ) -> bool:
        """Save if due (or ``force``); returns whether a checkpoint was written.

        ``tokenizer`` is a path passed on to the engine, or a tokenizer object that rank 0
        writes into the checkpoint with ``save_pretrained``.
        """
        if not self._due(step, force):
            return False
        path = self.get_save_path(
            self.config.fileroot, self.config.experiment_name, self.config.trial_name, epoch, step, global_step
        )
        os.makedirs(path, exist_ok=True)
        tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
        engine.save(SaveLoadMeta(path=path, weight_format="hf", tokenizer_path=tokenizer_path))
        if tokenizer is not None and tokenizer_path is None:
            if not hasattr(tokenizer, "save_pretrained"):
                raise TypeError(
                    f"Saver.save: tokenizer must be a path or have save_pretrained, got {type(tokenizer).__name__}"
                )
            if not dist.is_initialized() or dist.get_rank() == 0:
                tokenizer.save_pretrained(path)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state["freq_ctl"])
