"""The backends ``allocation_mode`` may name, and its one parser.

Each backend is a row: its ``allocation_mode`` name -> ``"module:Class"`` (or the class), in
:data:`TRAINING_ROWS` (engines) or :data:`INFERENCE_ROWS` (server kinds). The rows are strings, so
this module imports no engine, server client or torch; a class is imported (``importlib``) only when
its shape is read. ``tandemrl.engines.registry`` and ``tandemrl.inference.registry`` add, look up and
build backends over these same dicts (``register_engine`` / ``register_backend``).

The built-in rows' shapes (``parallel_dims``, ``moe_hybrid``, ``features``) are copied here, so that
parsing ``allocation_mode`` in a launcher imports nothing heavy; ``tests/unit/test_backend_features.py``
checks each copy against its class, and registering a name again drops its copy.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from tandemrl.api.allocation import AllocationMode, BackendShape, LazyShapes

# allocation_mode name -> "module:Class" (or the class) of its training engine.
TRAINING_ROWS: dict[str, str | type[Any]] = {
    "fsdp": "tandemrl.engines.fsdp:FSDPEngine",
    "deepspeed": "tandemrl.engines.deepspeed:DeepSpeedEngine",
    "megatron": "tandemrl.engines.megatron.engine:MegatronEngine",
}
# allocation_mode name -> "module:Class" (or the class) of its request builder/parser.
INFERENCE_ROWS: dict[str, str | type[Any]] = {
    "vllm": "tandemrl.inference.vllm:VLLMBackend",
    "sglang": "tandemrl.inference.sglang:SGLangBackend",
}

# What the built-in rows' classes declare.
TRAINING_KNOWN: dict[str, BackendShape] = {
    "fsdp": BackendShape("training", "dtc", features=frozenset({"lora", "fp32_head"})),
    "deepspeed": BackendShape("training", "dtc", features=frozenset({"fp32_head"})),
    "megatron": BackendShape("training", "dtpce", moe_hybrid=True, features=frozenset({"router_replay"})),
}
INFERENCE_KNOWN: dict[str, BackendShape] = {
    "vllm": BackendShape("inference", "dtp", features=frozenset({"token", "middleware", "lora_adapters", "judge"})),
    "sglang": BackendShape("inference", "dtp"),
}


def load_row(rows: Mapping[str, str | type[Any]], name: str) -> type[Any]:
    """The class of row ``name`` (a key of ``rows``), its module imported on first use."""
    target = rows[name]
    if isinstance(target, type):
        return target
    module, cls = target.split(":")
    loaded: type[Any] = getattr(importlib.import_module(module), cls)
    return loaded


# The rows as allocation_mode shapes: each class's declared parallel_dims (and features).
TRAINING_SHAPES = LazyShapes("training", TRAINING_ROWS, functools.partial(load_row, TRAINING_ROWS), TRAINING_KNOWN)
INFERENCE_SHAPES = LazyShapes("inference", INFERENCE_ROWS, functools.partial(load_row, INFERENCE_ROWS), INFERENCE_KNOWN)
# The tables allocation_mode is parsed against, looked up in this order.
BACKEND_TABLES = (TRAINING_SHAPES, INFERENCE_SHAPES)


def parse_allocation(spec: str) -> AllocationMode:
    """``spec`` parsed against the backend rows (``AllocationValidationError`` names a bad token)."""
    return AllocationMode.from_str(spec, *BACKEND_TABLES)
