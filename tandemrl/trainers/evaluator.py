"""Periodic evaluation during training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.utils import EvaluatorConfig
from tandemrl.trainers.freq import FreqControl, agree_with_rank0, epochs_finished


class Evaluator:
    """Runs an evaluation callable when due; call ``evaluate`` on every rank after every step."""

    def __init__(self, config: EvaluatorConfig, ft_spec: FinetuneSpec | None) -> None:
        if config.freq_epochs is not None and ft_spec is None:
            raise ValueError("Evaluator: freq_epochs is set but no FinetuneSpec was given to locate epoch ends")
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = FreqControl.from_config(config)

    def evaluate(self, evaluate_fn: Callable[[], Any], epoch: int, step: int, global_step: int) -> bool:
        """Call ``evaluate_fn()`` if due; returns whether it ran.

        ``step`` is the 0-based step within ``epoch``; it locates epoch ends.
        """
        due = self.freq_ctl.check(epochs=epochs_finished(step, self.ft_spec), steps=1)
        if self.freq_ctl.freq_secs is not None:
            due = agree_with_rank0(due)
        if not due:
            return False
        evaluate_fn()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state["freq_ctl"])
