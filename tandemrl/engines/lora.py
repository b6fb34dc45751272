"""Low-rank adapters on an HF model: wrapping, merging, and the PEFT adapter directory format.

``LoRALinear`` keeps the wrapped linear's own ``weight``/``bias`` (frozen), so the model's
state-dict names stay HF names; the adapter adds ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r]. Forward: ``y = W x + b + (alpha / r) * B(A(x))``.
The adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with
keys ``base_model.model.<module>.lora_{A,B}.weight``, the layout PEFT and vLLM read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from tandemrl.configs.engine import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose weight and bias are frozen, plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameters: no copy, names unchanged
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # nn.Linear's own init
        nn.init.zeros_(self.lora_B.weight)  # the adapted model starts equal to the base
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def check_lora(cfg: LoRAConfig) -> None:
    """One-line errors naming the field."""
    if cfg.rank < 0:
        raise ValueError(f"lora.rank must be >= 0, got {cfg.rank}")
    if cfg.rank and not cfg.target_modules:
        raise ValueError("lora.target_modules: empty; name at least one nn.Linear (e.g. q_proj)")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1), got {cfg.dropout}")


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze every weight of ``model`` and wrap the target linears in place; returns the wrapped names."""
    check_lora(cfg)
    targets = set(cfg.target_modules)
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, LoRALinear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise ValueError(f"lora.target_modules: none of {sorted(targets)} is an nn.Linear of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, mod in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(mod, cfg.rank, cfg.alpha, cfg.dropout))
    return [name for name, _ in found]


def is_adapter_key(name: str) -> bool:
    return name.endswith(_A) or name.endswith(_B)


def merged_items(
    sd: Mapping[str, torch.Tensor], scaling: float, full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model: ``W + scaling * B @ A`` for adapted weights, in ``sd`` order.

    ``full`` turns a stored (possibly sharded) tensor into a whole one; it is called lazily,
    so one tensor is materialized at a time.
    """
    for name, t in sd.items():
        if is_adapter_key(name):
            continue
        stem = name.removesuffix(".weight")
        if stem + _A in sd:
            w = full(t)
            a, b = full(sd[stem + _A]).float(), full(sd[stem + _B]).float()
            yield name, (w.float() + scaling * (b @ a)).to(w.dtype)
        else:
            yield name, full(t)


def adapter_items(sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors of ``sd`` under their PEFT names."""
    for name, t in sd.items():
        if is_adapter_key(name):
            yield PEFT_PREFIX + name, t


def write_adapter(path: str, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str) -> None:
    """A PEFT adapter directory at ``path`` (config + safetensors); call on one rank only."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    targets = sorted({n.removeprefix(PEFT_PREFIX).split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:  # last: a complete directory has a config
        json.dump(config, f, indent=2)


def read_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter config, tensors under their model names) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    cfg_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"not a LoRA adapter directory (no {ADAPTER_CONFIG}): {path}")
    with open(cfg_file) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    return config, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}


def merge_adapter_dir(base_dir: str, adapter_dir: str, out_dir: str) -> None:
    """Write base model + adapter as one HF directory (weights ``W + (alpha/r) B A``) that transformers
    and vLLM load; the tokenizer is copied when ``base_dir`` has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, adapter = read_adapter(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    sd = model.state_dict()
    missing = sorted({k.split(".lora_")[0] + ".weight" for k in adapter} - sd.keys())
    if missing:
        raise ValueError(f"{adapter_dir}: adapter targets weights the base model lacks, e.g. {missing[0]}")
    merged = dict(merged_items({**sd, **adapter}, config["lora_alpha"] / config["r"]))
    model.load_state_dict(merged)
    model.save_pretrained(out_dir)
    if any(f.startswith("tokenizer") for f in os.listdir(base_dir)):
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
