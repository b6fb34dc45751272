"""Which inference backend serves a name: one row per server kind, imported only when asked for.

A backend is one class (an :class:`~tandemrl.api.backend.InferenceBackend` that declares its
``parallel_dims``) plus one row: its ``allocation_mode`` name -> ``"module:Class"`` (or the class).
The rows live in ``tandemrl.configs.backends`` (``INFERENCE_ROWS``, read there by ``allocation_mode``
parsing); the launchers (:func:`get_backend`) and the client
(``RemoteInferenceClient.for_backend``) build from them here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandemrl.configs.backends import INFERENCE_KNOWN, INFERENCE_ROWS, load_row

if TYPE_CHECKING:
    from tandemrl.api.backend import InferenceBackend


def register_backend(name: str, target: str | type) -> None:
    """Add (or replace) the row of ``name``: ``"module:Class"`` or the class itself (an out-of-tree backend)."""
    INFERENCE_ROWS[name] = target
    INFERENCE_KNOWN.pop(name, None)  # its shape is read from the new class


def backend_class(name: str) -> type[Any]:
    """The backend class of ``name`` (a key of ``INFERENCE_ROWS``), imported on first use."""
    if name not in INFERENCE_ROWS:
        known = " or ".join(repr(k) for k in INFERENCE_ROWS)
        raise ValueError(f"unknown inference backend {name!r}; expected {known}")
    return load_row(INFERENCE_ROWS, name)


def get_backend(name: str, **kwargs: Any) -> InferenceBackend:
    """The backend called ``name`` (a key of ``INFERENCE_ROWS``); kwargs go to its constructor."""
    return backend_class(name)(**kwargs)
