"""Which inference backend serves a name; each is imported only when asked for."""

from __future__ import annotations

from typing import Any

from tandemrl.api.backend import InferenceBackend


def get_backend(name: str, **kwargs: Any) -> InferenceBackend:
    """The backend called ``name`` ("vllm" or "sglang"); kwargs go to its constructor."""
    if name == "vllm":
        from tandemrl.inference.vllm import VLLMBackend

        return VLLMBackend(**kwargs)
    if name == "sglang":
        from tandemrl.inference.sglang import SGLangBackend

        return SGLangBackend(**kwargs)
    raise ValueError(f"unknown inference backend {name!r}; expected 'vllm' or 'sglang'")
