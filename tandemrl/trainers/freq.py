"""When periodic actions (saving, evaluation, recovery checkpoints) fire."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.utils import FreqConfig


def _check_freq(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return value


class FreqControl:
    """Fires when any configured interval has elapsed since the last fire.

    ``check`` is told how many epochs and steps passed since the previous call, so the
    caller decides what an epoch boundary is; wall time is measured here.
    """

    def __init__(self, freq_epochs: int | None = None, freq_steps: int | None = None, freq_secs: int | None = None):
        self.freq_epochs = _check_freq("freq_epochs", freq_epochs)
        self.freq_steps = _check_freq("freq_steps", freq_steps)
        self.freq_secs = _check_freq("freq_secs", freq_secs)
        self._epochs = 0
        self._steps = 0
        self._last_time = time.monotonic()

    @classmethod
    def from_config(cls, config: FreqConfig) -> FreqControl:
        return cls(config.freq_epochs, config.freq_steps, config.freq_secs)

    def check(self, epochs: int, steps: int) -> bool:
        """Add the elapsed epochs/steps; True (and restart all counters) if an interval is due."""
        if epochs < 0 or steps < 0:
            raise ValueError(f"FreqControl.check: epochs and steps must be >= 0, got epochs={epochs} steps={steps}")
        self._epochs += epochs
        self._steps += steps
        now = time.monotonic()
        due = (
            (self.freq_epochs is not None and self._epochs >= self.freq_epochs)
            or (self.freq_steps is not None and self._steps >= self.freq_steps)
            or (self.freq_secs is not None and now - self._last_time >= self.freq_secs)
        )
        if due:
            self.reset(now)
        return due

    def reset(self, now: float | None = None) -> None:
        """Restart counting, e.g. after a forced action."""
        self._epochs = 0
        self._steps = 0
        self._last_time = time.monotonic() if now is None else now

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self._epochs, "steps": self._steps, "elapsed_secs": time.monotonic() - self._last_time}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume counters; the wall-time clock continues from the saved elapsed time."""
        missing = {"epochs", "steps", "elapsed_secs"} - set(state)
        if missing:
            raise KeyError(f"FreqControl.load_state_dict: missing keys {sorted(missing)}")
        self._epochs = int(state["epochs"])
        self._steps = int(state["steps"])
        self._last_time = time.monotonic() - float(state["elapsed_secs"])


def epochs_finished(step: int, ft_spec: FinetuneSpec | None) -> int:
    """1 if ``step`` (0-based, within its epoch) is the epoch's last step, else 0."""
    if ft_spec is None:
        return 0
    return int(step == ft_spec.steps_per_epoch - 1)


def agree_with_rank0(decision: bool) -> bool:
    """Rank 0's decision on every rank: wall-time checks differ between ranks, but collective
    actions (saving, evaluation) must fire on all of them or none."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])
