"""The HF model every backend trains and exports: built from a TrainEngineConfig, run on packed
micro-batches, written to and read from HF checkpoint directories.

Backends differ in how they shard and step this model, not in how it is built, called or saved,
so all of it lives here once (FSDP and DeepSpeed train it; Megatron converts from and to it).
Tokenizer and config loading for the rest of the library is in ``tandemrl.models.hf``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from tandemrl.api.types import SaveLoadMeta, TensorDict
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.prefix_sharing import unshare
from tandemrl.models.hf import load_hf_config
from tandemrl.models.varlen_attention import VARLEN_SDPA, register_varlen_attention

if TYPE_CHECKING:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_model_class(is_critic: bool) -> type[AutoModelForCausalLM] | type[AutoModelForTokenClassification]:
    """HF auto class of the engine's model: a causal LM, or a 1-label token classifier as critic."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    return AutoModelForTokenClassification if is_critic else AutoModelForCausalLM


def load_model_config(cfg: TrainEngineConfig) -> Any:
    """The HF config at ``cfg.path`` adjusted for packed training (and a value head for critics)."""
    if not cfg.path:
        raise ValueError("TrainEngineConfig.path: empty; set it to an HF model directory")
    if not os.path.isdir(cfg.path) and os.path.sep in cfg.path:
        raise FileNotFoundError(f"TrainEngineConfig.path: model directory not found: {cfg.path}")
    model_config = load_hf_config(cfg.path)
    # Packed inputs need no KV cache: with a cache, HF does not detect packing from
    # position_ids and lets tokens attend across sequence boundaries.
    model_config.use_cache = False
    if cfg.is_critic:  # value head: one output per token, deterministic (no classifier dropout)
        model_config.num_labels = 1
        model_config.classifier_dropout = 0.0
    return model_config


def build_hf_model(cfg: TrainEngineConfig, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(model on ``device`` in train mode, its HF config): weights from ``cfg.path`` or random (seeded)."""
    model_config = load_model_config(cfg)
    torch.manual_seed(cfg.seed)
    auto_cls = auto_model_class(cfg.is_critic)
    dtype = DTYPES[cfg.dtype]
    if cfg.attn_impl == VARLEN_SDPA:  # our per-sequence SDPA; HF must know the name before the build
        register_varlen_attention()
    if cfg.init_from_scratch:
        model = auto_cls.from_config(model_config, dtype=dtype, attn_implementation=cfg.attn_impl)
    else:
        model = auto_cls.from_pretrained(cfg.path, config=model_config, dtype=dtype, attn_implementation=cfg.attn_impl)
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.head_dtype is not None:
        if cfg.is_critic:
            raise ValueError("TrainEngineConfig.head_dtype: a critic has a value head, not an output head")
        fp32_head(model)
    model.train()  # from_pretrained returns eval mode
    return model, model_config


class Fp32Head(torch.nn.Linear):
    """An output head computing in fp32 whatever dtype its weights are kept or cast to: logits are not rounded
    to 16 bits (``TrainEngineConfig.head_dtype``); the gradient reaches the weights in their own dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def fp32_head(model: torch.nn.Module) -> None:
    """Make ``model``'s output head an :class:`Fp32Head` (same parameters, tied or not; same state dict)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"TrainEngineConfig.head_dtype: {type(model).__name__}'s output head is not a plain Linear")
    head.__class__ = Fp32Head


def packed_logits(model: torch.nn.Module, mb: TensorDict, attn_impl: str) -> torch.Tensor:
    """Logits [T, V] of one packed micro-batch (a single row with restarting ``position_ids``).

    A micro-batch carrying the prefix-shared layout (``shared_*`` fields) runs that row instead
    and returns the same [T, V] logits of the unshared packing.
    """
    if "shared_index" in mb:  # prefix-shared layout: run the shared row, map the logits back per token
        if attn_impl != VARLEN_SDPA:
            raise ValueError(f"prefix_sharing needs attn_impl={VARLEN_SDPA}, got '{attn_impl}'")
        out = model(
            input_ids=mb["shared_input_ids"].unsqueeze(0),
            position_ids=mb["shared_position_ids"].unsqueeze(0),
            use_cache=False,
            shared_block_cu=mb["shared_block_cu"],
            shared_block_prefix=mb["shared_block_prefix"],
        )
        return unshare(out.logits.squeeze(0), mb["shared_index"])
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
