"""Turn a configured model path into something loadable, failing early with a clear line."""

from __future__ import annotations

import os

from tandemrl.models.hf import is_plausible_hub_id

TINY_PREFIX = "tiny:"


def tiny_model_cache() -> str:
    """`${TANDEMRL_CACHE:-~/.cache/tandemrl}/tiny-models`, shared with the test suite."""
    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    return os.path.join(os.path.expanduser(root), "tiny-models")


def resolve_model_path(path: str, field: str = "path", corpus_path: str | None = None) -> str:
    """A local HF directory for ``path``.

    ``tiny:qwen2`` / ``tiny:qwen3_moe`` build (once, cached) a tiny model whose tokenizer
    is trained on ``corpus_path`` (a GSM8K-style jsonl directory) when it is local.
    A hub id is returned unchanged; a missing local path raises naming ``field``.
    """
    if not path:
        raise ValueError(f"{field}: empty; set it to an HF model directory, a hub id or tiny:qwen2")
    if path.startswith(TINY_PREFIX):
        from tandemrl.models.make_tiny import ensure_tiny_model

        corpus = corpus_path if corpus_path and os.path.isdir(corpus_path) else None
        return ensure_tiny_model(tiny_model_cache(), path[len(TINY_PREFIX) :] or "qwen2", corpus_path=corpus)
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(f"{field}: {path} has no config.json (not an HF model directory)")
        return local
    if path.startswith(("/", ".", "~")) or not is_plausible_hub_id(path):
        raise FileNotFoundError(f"{field}: model directory not found: {path}")
    return path
