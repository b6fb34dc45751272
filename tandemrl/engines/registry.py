"""Which class implements each training backend, imported only when asked for.

A backend is one class (a :class:`~tandemrl.api.engine.TrainBackend` that declares its
``parallel_dims``) plus one row: its ``allocation_mode`` name -> ``"module:Class"`` (or the
class). The rows live in ``tandemrl.configs.backends`` (``TRAINING_ROWS``, strings, so parsing
``allocation_mode`` there imports no engine); this module adds rows and builds engines from them.
Every algorithm (``tandemrl.algorithms``) takes the built engine, so a new backend works with all
of them and a new algorithm with all backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from tandemrl.configs.backends import TRAINING_KNOWN, TRAINING_ROWS, load_row

if TYPE_CHECKING:
    from tandemrl.api.engine import TrainBackend
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.base import BaseTrainEngine


def register_engine(backend: str, target: str | type[BaseTrainEngine]) -> None:
    """Register ``module:Class`` (or the class) as the engine of ``backend`` (e.g. an out-of-tree backend)."""
    TRAINING_ROWS[backend] = target
    TRAINING_KNOWN.pop(backend, None)  # its shape is read from the new class


def engine_class(backend: str) -> type[BaseTrainEngine]:
    """The engine class of ``backend``, e.g. ``engine_class("fsdp") -> FSDPEngine``."""
    if backend not in TRAINING_ROWS:
        raise ValueError(
            f"allocation_mode: no training engine for backend '{backend}' "
            f"(available: {', '.join(sorted(TRAINING_ROWS))})"
        )
    return cast("type[BaseTrainEngine]", load_row(TRAINING_ROWS, backend))


def make_engine(backend: str, config: TrainEngineConfig) -> TrainBackend:
    """An unbuilt engine of ``backend`` for ``config`` (call create_process_group, then initialize)."""
    return engine_class(backend)(config)
