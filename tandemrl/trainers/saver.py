"""Periodic HF-format checkpoints that inference servers and transformers can reload."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any, Protocol

import torch.distributed as dist

from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.utils import SaverConfig, save_root
from tandemrl.trainers.freq import FreqControl, agree_with_rank0, epochs_finished
from tandemrl.utils.cli import first_line, os_error_reason


class CheckpointWriteError(ValueError):
    """A checkpoint directory cannot be written (read-only, full, not a directory): one line naming it."""


# Not failures of a checkpoint: let them through whatever the handler catches.
NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit)


def checkpoint_cause(e: BaseException) -> BaseException:
    """The error under torch's ``CheckpointException`` (a BaseException holding each rank's (error, traceback)),
    else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return e


def _unwritable(path: str) -> str | None:
    """Why nothing can be written under ``path`` (e.g. "No space left on device (ENOSPC)"), or None if it can."""
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        return os_error_reason(e)
    return None


@contextlib.contextmanager
def writing_checkpoint(path: str, what: str) -> Iterator[None]:
    """Turn a failure to write under ``path`` into ``CheckpointWriteError`` naming it.

    Whatever raised (an OSError, torch's or safetensors' own wrappers of one), ``path`` is
    probed with a small write; other errors are re-raised unchanged.
    """
    try:
        yield
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, NOT_FAILURES):
            raise
        reason = _unwritable(path)
        if reason is not None:
            raise CheckpointWriteError(f"{what}: cannot write checkpoint to {path}: {reason}") from e
        if isinstance(e, Exception):
            raise
        cause = checkpoint_cause(e)
        raise CheckpointWriteError(
            f"{what}: writing checkpoint {path} failed: {type(cause).__name__}: {first_line(cause)}"
        ) from e


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
        self.last_path: str | None = None  # the newest checkpoint this run wrote

    @staticmethod
    def get_save_root(fileroot: str, experiment_name: str, trial_name: str) -> str:
        return save_root(fileroot, experiment_name, trial_name)

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
        last: bool = False,
    ) -> bool:
        """Save if due (or ``force``, or ``last`` with ``save_final`` on); returns whether one was written.

        ``last`` marks the run's final step: the trained model is saved whatever the frequency.

        ``tokenizer`` is a path passed on to the engine, or a tokenizer object that rank 0
        writes into the checkpoint with ``save_pretrained``.
        """
        if not self._due(step, force or (last and self.config.save_final)):
            return False
        path = self.get_save_path(
            self.config.fileroot, self.config.experiment_name, self.config.trial_name, epoch, step, global_step
        )
        tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
        if tokenizer is not None and tokenizer_path is None and not hasattr(tokenizer, "save_pretrained"):
            raise TypeError(
                f"Saver.save: tokenizer must be a path or have save_pretrained, got {type(tokenizer).__name__}"
            )
        # Written to <path>.tmp and renamed once complete: a crash mid-save never leaves a
        # half-written directory under a checkpoint's name.
        tmp = path + ".tmp"
        with writing_checkpoint(tmp, "saver"):
            if _is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            _barrier()
            engine.save(SaveLoadMeta(path=tmp, weight_format="hf", tokenizer_path=tokenizer_path))
            if tokenizer is not None and not isinstance(tokenizer, str) and _is_rank0():
                tokenizer.save_pretrained(tmp)
            _barrier()
            if _is_rank0():
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
        _barrier()
        self.last_path = path
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state["freq_ctl"])


def final_outputs_line(name: str, model_path: str | None, recover: Any = None) -> str:
    """The run's last line: where the final HF model (and the recoverable checkpoint) are, or that none was saved."""
    if model_path is None:
        line = f"{name}: no model saved (saver.save_final=false and no save was due)"
    else:
        line = f"{name}: final model (HF format, loadable by transformers and vLLM): {model_path}"
    if recover is not None and getattr(recover, "enabled", False) and os.path.isdir(recover.path):
        line += f"; recoverable checkpoint: {recover.path}"
    return line
