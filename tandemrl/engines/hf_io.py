"""HF checkpoint directories from and to full (unsharded) state dicts, for every backend.

A backend only gathers its sharded weights into one CPU state dict (or scatters one back);
writing a directory that transformers and inference servers reload is the same for all.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandemrl.api.types import SaveLoadMeta
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.base import DTYPES
from tandemrl.engines.hf_model import auto_model_class


def save_hf_dir(sd: dict[str, torch.Tensor], model_config: Any, cfg: TrainEngineConfig, meta: SaveLoadMeta) -> None:
    """Write ``sd`` (full HF-named weights) as safetensors + config + tokenizer; call on one rank only."""
    from transformers import AutoTokenizer

    os.makedirs(meta.path, exist_ok=True)
    with torch.device("meta"):  # no memory: the weights come from sd
        fresh = auto_model_class(cfg.is_critic).from_config(model_config, dtype=DTYPES[cfg.dtype])
    fresh.load_state_dict(sd, assign=True)
    fresh.config.use_cache = True  # the exported model is for generation
    fresh.save_pretrained(meta.path, state_dict=sd)
    tok_path = meta.tokenizer_path or cfg.tokenizer_path or cfg.path
    if tok_path:
        AutoTokenizer.from_pretrained(tok_path).save_pretrained(meta.path)


def read_hf_state_dict(path: str, model_config: Any) -> dict[str, torch.Tensor]:
    """All ``*.safetensors`` tensors under ``path`` on the CPU, with a tied ``lm_head.weight`` restored."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(os.path.join(path, f)))
    if "lm_head.weight" not in sd and getattr(model_config, "tie_word_embeddings", False):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd
