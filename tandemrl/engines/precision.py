"""Which dtypes an engine keeps its weights in and computes in (``dtype`` and ``mixed_precision``).

One meaning on every backend: ``mixed_precision`` is the compute dtype of forward and backward;
master weights, optimizer states and gradient reductions stay in ``dtype``. How FSDP2, DeepSpeed
and Megatron-core each get there: docs/precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.hf_model import DTYPES


@dataclass(frozen=True)
class Precision:
    """``weights``: the dtype of the weights the engine keeps; ``compute``: of forward and backward."""

    weights: torch.dtype
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        """16-bit compute over fp32 weights."""
        return self.compute != self.weights


def resolve_precision(cfg: TrainEngineConfig) -> Precision:
    """The engine's dtypes; a one-line error names the field on a combination that has no meaning."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"TrainEngineConfig.dtype: unknown dtype '{cfg.dtype}' (expected one of {', '.join(DTYPES)})")
    weights = DTYPES[cfg.dtype]
    if not cfg.mixed_precision:
        return Precision(weights, weights)
    if cfg.mixed_precision not in DTYPES:
        raise ValueError(
            f"TrainEngineConfig.mixed_precision: unknown dtype '{cfg.mixed_precision}' "
            f"(expected bfloat16, float16 or null)"
        )
    compute = DTYPES[cfg.mixed_precision]
    if weights != torch.float32 and compute != weights:
        raise ValueError(
            f"TrainEngineConfig.mixed_precision={cfg.mixed_precision} needs dtype=float32 (the master weights), "
            f"got dtype={cfg.dtype}"
        )
    return Precision(weights, compute)
