"""HF model helpers: loading tokenizers/configs and building tiny test models.

Kept import-light: transformers/torch load only when a function is called.
"""

from __future__ import annotations

from typing import Any

from tandemrl.models.hf import is_plausible_hub_id, load_hf_config, load_hf_tokenizer

__all__ = ["ensure_tiny_model", "is_plausible_hub_id", "load_hf_config", "load_hf_tokenizer", "make_tiny_model"]


def __getattr__(name: str) -> Any:
    # Lazy so `python -m tandemrl.models.make_tiny` does not import the module twice.
    if name in ("make_tiny_model", "ensure_tiny_model"):
        from tandemrl.models import make_tiny

        return getattr(make_tiny, name)
    raise AttributeError(f"module 'tandemrl.models' has no attribute {name!r}")
