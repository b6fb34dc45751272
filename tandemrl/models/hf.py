"""Load HF tokenizers and configs from a local directory or a hub id, with clear errors."""

from __future__ import annotations

import os
import re
from typing import Any

# owner/name or name: what the hub accepts; anything else can only be a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def is_plausible_hub_id(path: str) -> bool:
    """True if `path` could name a hub repo (and so is not obviously a missing local path)."""
    return bool(_HUB_ID.match(path)) and ".." not in path and not path.endswith((".json", ".jsonl"))


def _check_source(path: str | os.PathLike[str], what: str) -> str:
    path = os.fspath(path)
    if os.path.exists(os.path.expanduser(path)):
        return os.path.expanduser(path)
    if not is_plausible_hub_id(path):
        raise FileNotFoundError(f"{what} path not found: {path!r} (no such local path, and not a valid HF hub id)")
    return path


# Files of which a local tokenizer directory holds at least one; without any, transformers quietly builds an
# empty tokenizer (one token) from the model's config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer_dir(path: str, field: str = "tokenizer") -> None:
    """A local ``path`` must hold a tokenizer: one line naming ``field`` and the directory if it has none.

    A hub id is not checked here (it is fetched when loaded).
    """
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        if not is_plausible_hub_id(path):
            raise FileNotFoundError(f"{field}: tokenizer directory not found: {path}")
        return
    if not os.path.isdir(local) or not any(os.path.isfile(os.path.join(local, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{field}: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer files "
            "into it or set tokenizer_path to a directory that has them"
        )


def load_hf_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """Fast tokenizer of a model; pad falls back to eos so batches can always be padded.

    Returns a `transformers.PreTrainedTokenizerFast` (TokenizersBackend in transformers 5).
    """
    from transformers import AutoTokenizer

    src = _check_source(path, "tokenizer")
    check_tokenizer_dir(src)
    tokenizer = AutoTokenizer.from_pretrained(src, use_fast=True, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer at {src!r} has no fast (tokenizers) backend; a tokenizer.json is required")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {src!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_hf_config(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The `transformers.PretrainedConfig` of a model directory or hub id."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_check_source(path, "model config"), trust_remote_code=trust_remote_code)


def model_context_length(path: str | os.PathLike[str]) -> int | None:
    """The model's context (``max_position_embeddings`` of its HF config), None if it declares none."""
    n = getattr(load_hf_config(path), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None
