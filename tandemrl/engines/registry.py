"""Which class implements each training backend, imported only when asked for.

A backend is one class (a :class:`~tandemrl.api.engine.TrainBackend` that declares its
``parallel_dims``) plus one row here: its ``allocation_mode`` name -> ``"module:Class"`` (or
the class). ``allocation_mode`` parsing reads the rows through :data:`SHAPES`. Every algorithm
(``tandemrl.algorithms``) takes the
built engine, so a new backend works with all of them and a new algorithm with all backends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tandemrl.api.allocation import BackendShape, LazyShapes

if TYPE_CHECKING:
    from tandemrl.api.engine import TrainBackend
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.base import BaseTrainEngine

_ENGINES: dict[str, str | type[BaseTrainEngine]] = {
    "fsdp": "tandemrl.engines.fsdp:FSDPEngine",
    "deepspeed": "tandemrl.engines.deepspeed:DeepSpeedEngine",
    "megatron": "tandemrl.engines.megatron.engine:MegatronEngine",
}
# What the built-in rows' classes declare, so that parsing allocation_mode imports no engine (nor
# torch: a launcher stays light). tests/test_backend_features checks each against its class;
# registering a name again drops its row here.
_KNOWN: dict[str, BackendShape] = {
    "fsdp": BackendShape("training", "dtc", features=frozenset({"lora"})),
    "deepspeed": BackendShape("training", "dtc"),
    "megatron": BackendShape("training", "dtpce", moe_hybrid=True, features=frozenset({"router_replay"})),
}


def register_engine(backend: str, target: str | type[BaseTrainEngine]) -> None:
    """Register ``module:Class`` (or the class) as the engine of ``backend`` (e.g. an out-of-tree backend)."""
    _ENGINES[backend] = target
    _KNOWN.pop(backend, None)


def engine_class(backend: str) -> type[BaseTrainEngine]:
    """The engine class of ``backend``, e.g. ``engine_class("fsdp") -> FSDPEngine``."""
    try:
        target = _ENGINES[backend]
    except KeyError:
        raise ValueError(
            f"allocation_mode: no training engine for backend '{backend}' (available: {', '.join(sorted(_ENGINES))})"
        ) from None
    if isinstance(target, type):
        return target
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


# The rows as allocation_mode shapes: each class's declared parallel_dims (and features).
SHAPES = LazyShapes("training", _ENGINES, engine_class, _KNOWN)


def make_engine(backend: str, config: TrainEngineConfig) -> TrainBackend:
    """An unbuilt engine of ``backend`` for ``config`` (call create_process_group, then initialize)."""
    return engine_class(backend)(config)
