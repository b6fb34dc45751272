"""The HF model every backend trains: built from a TrainEngineConfig, run on packed micro-batches.

Backends differ in how they shard and step this model, not in how it is built or called,
so both live here once (FSDP and DeepSpeed use them; Megatron converts from it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandemrl.api.types import TensorDict
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.models.varlen_attention import VARLEN_SDPA, register_varlen_attention


def auto_model_class(is_critic: bool) -> type:
    """HF auto class of the engine's model: a causal LM, or a 1-label token classifier as critic."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    return AutoModelForTokenClassification if is_critic else AutoModelForCausalLM


def load_model_config(cfg: TrainEngineConfig) -> Any:
    """The HF config at ``cfg.path`` adjusted for packed training (and a value head for critics)."""
    from transformers import AutoConfig

    if not cfg.path:
        raise ValueError("TrainEngineConfig.path: empty; set it to an HF model directory")
    if not os.path.isdir(cfg.path) and os.path.sep in cfg.path:
        raise FileNotFoundError(f"TrainEngineConfig.path: model directory not found: {cfg.path}")
    model_config = AutoConfig.from_pretrained(cfg.path)
    # Packed inputs need no KV cache: with a cache, HF does not detect packing from
    # position_ids and lets tokens attend across sequence boundaries.
    model_config.use_cache = False
    if cfg.is_critic:  # value head: one output per token, deterministic (no classifier dropout)
        model_config.num_labels = 1
        model_config.classifier_dropout = 0.0
    return model_config


def build_hf_model(cfg: TrainEngineConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(model on ``device`` in train mode, its HF config): weights from ``cfg.path`` or random (seeded)."""
    model_config = load_model_config(cfg)
    torch.manual_seed(cfg.seed)
    auto_cls = auto_model_class(cfg.is_critic)
    if cfg.attn_impl == VARLEN_SDPA:  # our per-sequence SDPA; HF must know the name before the build
        register_varlen_attention()
    if cfg.init_from_scratch:
        model = auto_cls.from_config(model_config, dtype=dtype, attn_implementation=cfg.attn_impl)
    else:
        model = auto_cls.from_pretrained(cfg.path, config=model_config, dtype=dtype, attn_implementation=cfg.attn_impl)
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # from_pretrained returns eval mode
    return model, model_config


def packed_logits(model: torch.nn.Module, mb: TensorDict, attn_impl: str) -> torch.Tensor:
    """Logits [T, V] of one packed micro-batch (a single row with restarting ``position_ids``)."""
    varlen: dict[str, torch.Tensor | int] = {}
    if attn_impl == VARLEN_SDPA:  # sequence boundaries, so attention costs sum(len^2), not T^2
        cu, max_len = mb["cu_seqlens"], int(mb["max_seqlen"])
        varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    out = model(
        input_ids=mb["input_ids"].unsqueeze(0),
        position_ids=mb["position_ids"].unsqueeze(0),
        use_cache=False,
        **varlen,
    )
    return out.logits.squeeze(0)
