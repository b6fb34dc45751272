"""Sampling parameters of one generation request (a value type every layer shares)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass
class GenerationHyperparameters:
    """Sampling parameters of one generation request."""

    n_samples: int = field(default=1, metadata={"help": "Samples generated per prompt.", "min": 1})
    max_new_tokens: int = field(default=256, metadata={"help": "Maximum generated tokens.", "min": 1})
    min_new_tokens: int = field(
        default=0, metadata={"help": "Minimum generated tokens before a stop is allowed.", "min": 0}
    )
    greedy: bool = field(default=False, metadata={"help": "Argmax decoding (ignores temperature/top_p/top_k/min_p)."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (0 samples greedily, as greedy: true does).", "min": 0.0}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass, in (0, 1].", "gt": 0.0, "max": 1.0})
    top_k: int = field(default=-1, metadata={"help": "Top-k sampling; -1 disables."})
    min_p: float = field(
        default=0.0,
        metadata={
            "help": "Min-p sampling (drop tokens under min_p x the top probability); 0 disables.",
            "min": 0.0,
            "max": 1.0,
        },
    )
    stop_token_ids: list[int] = field(default_factory=list, metadata={"help": "Extra token ids that end generation."})
    stop: list[str] | None = field(default=None, metadata={"help": "Strings that end generation."})
    frequency_penalty: float = field(default=0.0, metadata={"help": "Penalty on repeated tokens."})

    def new(self, **changes: Any) -> GenerationHyperparameters:
        """A copy with some fields changed (e.g. ``gconfig.new(greedy=True)``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
