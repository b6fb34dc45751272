"""Which inference backend serves a name: one row per server kind, imported only when asked for.

A backend is one class (an :class:`~tandemrl.api.backend.InferenceBackend` that declares its
``parallel_dims``) plus one row here; ``allocation_mode`` parsing (:data:`SHAPES`), the
launchers (:func:`get_backend`) and the client (:func:`make_client`) all read this table.
"""

from __future__ import annotations

import importlib
from typing import Any

from tandemrl.api.allocation import LazyShapes
from tandemrl.api.backend import InferenceBackend

# allocation_mode name -> "module:Class" (or the class) of its request builder/parser.
BACKENDS: dict[str, str | type] = {
    "vllm": "tandemrl.inference.vllm:VLLMBackend",
    "sglang": "tandemrl.inference.sglang:SGLangBackend",
}


def register_backend(name: str, target: str | type) -> None:
    """Add (or replace) the row of ``name``: ``"module:Class"`` or the class itself (an out-of-tree backend)."""
    BACKENDS[name] = target


def backend_class(name: str) -> type[Any]:
    """The backend class of ``name`` (a key of ``BACKENDS``), imported on first use."""
    if name not in BACKENDS:
        known = " or ".join(repr(k) for k in BACKENDS)
        raise ValueError(f"unknown inference backend {name!r}; expected {known}")
    target = BACKENDS[name]
    if isinstance(target, type):
        return target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


# The rows as allocation_mode shapes: each class's declared parallel_dims, read on lookup.
SHAPES = LazyShapes("inference", BACKENDS, backend_class)


def get_backend(name: str, **kwargs: Any) -> InferenceBackend:
    """The backend called ``name`` (a key of ``BACKENDS``); kwargs go to its constructor."""
    return backend_class(name)(**kwargs)
