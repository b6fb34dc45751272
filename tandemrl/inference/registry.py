"""Which inference backend serves a name: one row per server kind, imported only when asked for.

A backend is one class (an :class:`~tandemrl.api.backend.InferenceBackend` that declares its
``parallel_dims``) plus one row here; ``allocation_mode`` parsing (:data:`SHAPES`), the
launchers (:func:`get_backend`) and the client (:func:`make_client`) all read this table.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tandemrl.api.allocation import BackendShape, LazyShapes

if TYPE_CHECKING:
    from tandemrl.api.backend import InferenceBackend

# allocation_mode name -> "module:Class" (or the class) of its request builder/parser.
BACKENDS: dict[str, str | type] = {
    "vllm": "tandemrl.inference.vllm:VLLMBackend",
    "sglang": "tandemrl.inference.sglang:SGLangBackend",
}
# What the built-in rows' classes declare, so that parsing allocation_mode imports no backend
# module. tests/test_backend_features checks each against its class; registering a name again drops its row here.
_KNOWN: dict[str, BackendShape] = {
    "vllm": BackendShape("inference", "dtp", features=frozenset({"token", "middleware", "lora_adapters", "judge"})),
    "sglang": BackendShape("inference", "dtp"),
}


def register_backend(name: str, target: str | type) -> None:
    """Add (or replace) the row of ``name``: ``"module:Class"`` or the class itself (an out-of-tree backend)."""
    BACKENDS[name] = target
    _KNOWN.pop(name, None)


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


# The rows as allocation_mode shapes: each class's declared parallel_dims (and features).
SHAPES = LazyShapes("inference", BACKENDS, backend_class, _KNOWN)


def get_backend(name: str, **kwargs: Any) -> InferenceBackend:
    """The backend called ``name`` (a key of ``BACKENDS``); kwargs go to its constructor."""
    return backend_class(name)(**kwargs)
