"""Which inference backend serves a name: one row per server kind, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from tandemrl.api.backend import InferenceBackend

# allocation_mode name -> "module:Class" of its request builder/parser (an InferenceBackend).
BACKENDS: dict[str, str] = {
    "vllm": "tandemrl.inference.vllm:VLLMBackend",
    "sglang": "tandemrl.inference.sglang:SGLangBackend",
}


def get_backend(name: str, **kwargs: Any) -> InferenceBackend:
    """The backend called ``name`` (a key of ``BACKENDS``); kwargs go to its constructor."""
    if name not in BACKENDS:
        known = " or ".join(repr(k) for k in BACKENDS)
        raise ValueError(f"unknown inference backend {name!r}; expected {known}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
