"""Whether a run's updates carry any learning signal: steps whose advantages are all zero or whose gradient is 0.

A GRPO group whose samples all earn the same reward has zero advantages, so a batch in which no group has a
rewarded and an unrewarded sample trains nothing (a LoRA adapter initialised at zero then stays at zero, and
a "merged" model is bit-identical to the base). The loss and the step still run, so such a run looks healthy.
:class:`SignalWatch` reads each step's exported stats, warns once when ``warn_no_signal_steps`` steps in a
row carried no signal, and counts them for the closing line.
"""

from __future__ import annotations

from collections.abc import Mapping

_ADV_MIN, _ADV_MAX = "/advantages/min", "/advantages/max"


def no_signal_reason(stats: Mapping[str, float]) -> str | None:
    """Why this step's update carried no signal ("all advantages 0", "grad_norm 0"), or None if it did.

    Reads the actor's stats: every ``.../advantages/min`` and ``/max`` pair, and every ``actor/.../grad_norm``.
    A step that recorded neither is not judged (None).
    """
    pairs = [(v, stats.get(k[: -len(_ADV_MIN)] + _ADV_MAX)) for k, v in stats.items() if k.endswith(_ADV_MIN)]
    if pairs and all(lo == 0.0 and hi == 0.0 for lo, hi in pairs):
        return "all advantages 0: every group's samples earned the same reward"
    norms = [v for k, v in stats.items() if k.startswith("actor/") and k.endswith("/grad_norm")]
    if norms and all(v == 0.0 for v in norms):
        return "grad_norm 0 on every update"
    return None


class SignalWatch:
    """Counts steps without a learning signal; ``observe`` returns a warning when a streak reaches ``warn_after``."""

    def __init__(self, warn_after: int) -> None:
        self.warn_after = warn_after  # 0: never warn (still counted for the closing line)
        self.streak = 0
        self.steps_without = 0
        self.steps_seen = 0
        self.last_reason = ""
        self._warned = False

    def observe(self, stats: Mapping[str, float]) -> str | None:
        self.steps_seen += 1
        reason = no_signal_reason(stats)
        if reason is None:
            self.streak = 0
            return None
        self.streak += 1
        self.steps_without += 1
        self.last_reason = reason
        if self.warn_after and self.streak == self.warn_after and not self._warned:
            self._warned = True
            return (
                f"warning: no learning signal for {self.streak} steps in a row ({reason}); the model is not "
                "changing. Rewards that never differ within a group: try an easier task, more samples per prompt "
                "(gconfig.n_samples), a lower temperature, or a model that solves some prompts"
            )
        return None

    def closing(self) -> str | None:
        """The closing line's clause, None when every step carried a signal."""
        if not self.steps_without:
            return None
        return f"{self.steps_without} of {self.steps_seen} steps carried no learning signal ({self.last_reason})"
