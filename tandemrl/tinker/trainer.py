"""Many LoRA adapters on one base model: the training side of ``tandemrl tinker-serve``.

The base HF model is loaded once and its target linears are wrapped by tandemrl's
``LoRALinear`` (``tandemrl.engines.lora``). Each Tinker training client owns its own adapter
tensors (``A``, ``B`` per target module) and its own AdamW state; before a call the client's
tensors are put into the wrapped modules (no copy: the modules' ``lora_A``/``lora_B`` take the
client's Parameters), so one forward/backward serves any client. Calls run one at a time,
in the order they were submitted (the service's single training worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from tandemrl.algorithms.tinker_losses import tinker_loss
from tandemrl.configs.engine import LoRAConfig
from tandemrl.engines.lora import LoRALinear, apply_lora, read_adapter, write_adapter
from tandemrl.models.functional import gather_logprobs

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# alpha 32 at every rank, as Tinker's service (its cookbook's LoRA learning-rate helper assumes lora_alpha=32):
# the adapter scale is 32 / rank, so a learning rate tuned on Tinker means the same here.
ALPHA = 32.0


def set_adam_params(param_groups: list[dict[str, Any]], adam: dict[str, Any]) -> None:
    """One ``optim_step``'s Adam parameters (Tinker sends them with every step), with the SDK's defaults."""
    for group in param_groups:
        group["lr"] = float(adam.get("learning_rate", 1e-4))
        group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        group["eps"] = float(adam.get("eps", 1e-12))
        group["weight_decay"] = float(adam.get("weight_decay", 0.0))


@dataclass
class Adapter:
    """One training client's adapter: its Parameters by module name, its optimizer, its grads."""

    rank: int
    targets: tuple[str, ...]
    params: dict[str, tuple[nn.Parameter, nn.Parameter]]
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending: int = 0  # forward_backward calls whose grads wait for optim_step
    meta: dict[str, Any] = field(default_factory=dict)


def targets_of(train_attn: bool, train_mlp: bool) -> tuple[str, ...]:
    targets = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    if not targets:
        raise ValueError("lora_config: train_attn and train_mlp are both false; nothing to adapt")
    return targets


class AdapterTrainer:
    """The base model plus the adapters of every training client (see the module docstring)."""

    def __init__(self, model_dir: str, max_rank: int, device: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.max_rank = max_rank
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # Wrap every target once (rank 1 placeholders); clients bring their own A and B.
        self.wrapped = apply_lora(model, LoRAConfig(rank=1, alpha=ALPHA, target_modules=list(ATTN + MLP)))
        self.model = torch.nn.Module.to(model, self.device).train()
        self.modules = {n: cast(LoRALinear, model.get_submodule(n)) for n in self.wrapped}
        self.adapters: dict[str, Adapter] = {}

    # ------------------------------------------------------------------ adapters
    def add(self, model_id: str, rank: int, targets: tuple[str, ...], seed: int | None) -> None:
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"lora_config.rank: {rank} is outside 1..{self.max_rank} (the server's --max-lora-rank)")
        gen = torch.Generator().manual_seed(seed if seed is not None else len(self.adapters))
        params: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for name, mod in self.modules.items():
            if name.rsplit(".", 1)[-1] not in targets:
                continue
            bound = 1.0 / mod.in_features**0.5  # nn.Linear's Kaiming-uniform bound for A
            a = (torch.rand(rank, mod.in_features, generator=gen) * 2 - 1) * bound
            b = torch.zeros(mod.out_features, rank)
            params[name] = (nn.Parameter(a.to(self.device)), nn.Parameter(b.to(self.device)))
        flat = [p for ab in params.values() for p in ab]
        opt = torch.optim.AdamW(flat, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.adapters[model_id] = Adapter(rank, targets, params, opt)

    def remove(self, model_id: str) -> None:
        self.adapters.pop(model_id, None)

    def _activate(self, ad: Adapter) -> None:
        for name, mod in self.modules.items():
            if name in ad.params:
                mod.lora_A.weight, mod.lora_B.weight = ad.params[name]
                mod.scaling = ALPHA / ad.rank
            else:
                mod.scaling = 0.0  # not a target of this client: the adapter path adds nothing

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, model_id: str, data: list[dict[str, torch.Tensor]], loss_fn: str, config: dict[str, float], backward: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per-datum ``logprobs`` and ``elementwise_loss`` and the summed loss; grads accumulate if ``backward``."""
        ad = self.adapters[model_id]
        self._activate(ad)
        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        with torch.set_grad_enabled(backward):
            for datum in data:
                ids = datum["input_ids"].to(self.device)[None]
                logits = self.model(input_ids=ids, use_cache=False).logits[0]
                logp = gather_logprobs(logits, datum["target_tokens"].to(self.device))
                inputs = {k: v.to(self.device) for k, v in datum.items() if k not in ("input_ids", "target_tokens")}
                per_token = tinker_loss(loss_fn, logp, inputs, config)
                loss = per_token.sum()
                if backward:
                    loss.backward()
                total += float(loss.detach())
                outputs.append({"logprobs": logp.detach().cpu(), "elementwise_loss": per_token.detach().cpu()})
        if backward:
            ad.pending += 1
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step with this call's parameters (Tinker sends them per step), then zero the grads."""
        ad = self.adapters[model_id]
        params = [p for ab in ad.params.values() for p in ab]
        clip = float(adam.get("grad_clip_norm", 0.0))
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        set_adam_params(ad.optimizer.param_groups, adam)
        ad.optimizer.step()
        ad.optimizer.zero_grad(set_to_none=True)
        ad.steps += 1
        ad.pending = 0
        return {"grad_norm": float(norm), "step": float(ad.steps)}

    # ------------------------------------------------------------------ checkpoints
    def _tensors(self, ad: Adapter) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, (a, b) in ad.params.items():
            out[f"base_model.model.{name}.lora_A.weight"] = a.detach().cpu()
            out[f"base_model.model.{name}.lora_B.weight"] = b.detach().cpu()
        return out

    def save_adapter(self, model_id: str, path: str) -> None:
        """The PEFT adapter directory vLLM loads (``tandemrl.engines.lora.write_adapter``)."""
        ad = self.adapters[model_id]
        write_adapter(path, self._tensors(ad), LoRAConfig(rank=ad.rank, alpha=ALPHA), self.model_dir)

    def save_state(self, model_id: str, path: str) -> None:
        """Adapter plus optimizer state (``load_state`` restores both)."""
        self.save_adapter(model_id, path)
        ad = self.adapters[model_id]
        torch.save({"optimizer": ad.optimizer.state_dict(), "steps": ad.steps}, os.path.join(path, "optimizer.pt"))

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        ad = self.adapters[model_id]
        config, tensors = read_adapter(path)
        if int(config["r"]) != ad.rank:
            raise ValueError(f"load_weights: checkpoint rank {config['r']} != this model's rank {ad.rank}")
        with torch.no_grad():
            for name, (a, b) in ad.params.items():
                a.copy_(tensors[f"{name}.lora_A.weight"])
                b.copy_(tensors[f"{name}.lora_B.weight"])
        opt_file = os.path.join(path, "optimizer.pt")
        if optimizer and os.path.isfile(opt_file):
            state = torch.load(opt_file, weights_only=False)
            ad.optimizer.load_state_dict(state["optimizer"])
            ad.steps = int(state["steps"])
