"""Sends committed statistics to the console, Weights & Biases and TensorBoard (global rank 0 only)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.utils import StatsLoggerConfig
from tandemrl.utils.files import append_text, names_file

_WANDB_MODES = ("online", "offline", "disabled")


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"StatsLogger.commit: {key!r} must be a single number, got shape {tuple(value.shape)}")
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"StatsLogger.commit: {key!r} must be a number, got {type(value).__name__}") from None


def format_table(stats: Mapping[str, float]) -> str:
    """Two aligned columns, keys sorted, values in 4 significant digits."""
    if not stats:
        return "(no statistics)"
    width = max(len(k) for k in stats)
    return "\n".join(f"{k:<{width}}  {v:.4g}" for k, v in sorted(stats.items()))


_TENSORBOARD_HOOKS: list[object] = []  # the excepthook installed below, once per process


def _quiet_tensorboard_writer_thread() -> None:
    """tensorboard writes events on a thread of its own, which keeps a failed write (a full disk) for the next
    ``add_scalar``/``flush`` to raise, named in the rank's one error line; the thread's own traceback on stderr
    would repeat it as noise. Every other thread's exception is printed as before."""
    if threading.excepthook in _TENSORBOARD_HOOKS:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    _TENSORBOARD_HOOKS.append(hook)
    threading.excepthook = hook


class StatsLogger:
    """Rank-0 sink for exported statistics; every method is a no-op on other ranks."""

    def __init__(self, config: StatsLoggerConfig, ft_spec: FinetuneSpec | None = None) -> None:
        if config.wandb.mode not in _WANDB_MODES:
            raise ValueError(f"stats_logger.wandb.mode must be one of {_WANDB_MODES}, got {config.wandb.mode!r}")
        self.config = config
        self.ft_spec = ft_spec
        self._wandb_run: Any = None
        self._writer: Any = None
        self._tensorboard = ""  # the writer's directory, named by a failed write
        self._jsonl: str | None = None
        if not _is_rank0():
            return
        if config.wandb.mode != "disabled":
            self._init_wandb()
        if config.tensorboard.path:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = config.tensorboard.path
            os.makedirs(self._tensorboard, exist_ok=True)
            _quiet_tensorboard_writer_thread()
            with names_file(self._tensorboard):  # its first event is written and flushed here
                self._writer = SummaryWriter(log_dir=self._tensorboard)
        if config.jsonl:
            os.makedirs(self.log_dir, exist_ok=True)
            self._jsonl = os.path.join(self.log_dir, "stats.jsonl")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.config.fileroot, "logs", self.config.experiment_name, self.config.trial_name)

    def _init_wandb(self) -> None:
        import wandb  # lazy: slow to import and only needed when enabled

        cfg = self.config.wandb
        os.makedirs(self.log_dir, exist_ok=True)
        # wandb writes its run directory under <dir>/wandb, i.e. <log_dir>/wandb.
        self._wandb_run = wandb.init(
            mode=cast(Literal["online", "offline", "disabled"], cfg.mode),  # one of WandBConfig.mode's choices
            project=cfg.project or self.config.experiment_name,
            entity=cfg.entity,
            name=cfg.name or self.config.trial_name,
            tags=list(cfg.tags) if cfg.tags else None,
            dir=self.log_dir,
        )

    def _header(self, epoch: int, step: int, global_step: int) -> str:
        if self.ft_spec is None:
            return f"epoch {epoch + 1} step {step + 1} global step {global_step + 1}"
        spec = self.ft_spec
        return (
            f"epoch {epoch + 1}/{spec.total_train_epochs} step {step + 1}/{spec.steps_per_epoch} "
            f"global step {global_step + 1}/{spec.total_train_steps}"
        )

    def commit(
        self, epoch: int, step: int, global_step: int, stats: Mapping[str, Any] | list[Mapping[str, Any]]
    ) -> None:
        """Log one step's statistics (0-based counters); a list of dicts is merged, later wins."""
        if not _is_rank0():
            return
        items = [stats] if isinstance(stats, Mapping) else list(stats)
        data: dict[str, float] = {}
        for item in items:
            for key, value in item.items():
                if not key.endswith("__count"):
                    data[key] = _to_float(key, value)
        if self.config.console:
            print(f"{self._header(epoch, step, global_step)}\n{format_table(data)}", flush=True)
        if self._wandb_run is not None:
            self._wandb_run.log(data, step=global_step)
        if self._writer is not None:
            with names_file(self._tensorboard):
                for key, value in data.items():
                    self._writer.add_scalar(key, value, global_step)
                self._writer.flush()
        if self._jsonl is not None:
            append_text(self._jsonl, json.dumps({"step": global_step + 1, **data}) + "\n")

    def plot(self) -> str | None:
        """Draw curves.png from this run's stats.jsonl and print its path; None when there is nothing to draw."""
        if self._jsonl is None or not os.path.isfile(self._jsonl):
            return None
        from tandemrl.trainers.plots import plot_curves

        out = plot_curves(self._jsonl)
        if out is not None:
            print(f"curves (reward, accuracy, response length, KL/mismatch per step): {out}", flush=True)
        return out

    def draw_curves(self) -> None:
        """``plot`` once, when ``stats_logger.plot`` is on; no more stats.jsonl lines are written after it."""
        if self.config.plot and self._jsonl is not None:
            self.plot()
            self._jsonl = None

    def close(self) -> None:
        """Draw the curves (``draw_curves``, unless drawn already), flush and release the backends; safe to call
        twice."""
        self.draw_curves()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with names_file(self._tensorboard):
                writer.close()
