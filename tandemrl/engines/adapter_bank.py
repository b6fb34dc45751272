"""Many LoRA adapters on one engine's model, each with its own tensors and optimizer state.

The engine is built with ``lora.rank`` = the largest rank served, on every target linear. An adapter
of rank ``r`` lives in the first ``r`` rows of each ``lora_A`` and the first ``r`` columns of each
``lora_B``; the rest is zero and stays zero (a zero row of A with a zero column of B gets a zero
gradient, hence a zero AdamW update), so the padded adapter computes exactly the rank-``r`` one.
Modules an adapter does not target hold zeros for it and get scaling 0.

``activate(name)`` copies the adapter's tensors into the modules (this rank's shard, under FSDP2),
sets each module's ``scaling`` and puts the adapter's AdamW state and its accumulated gradients into
the engine's optimizer and parameters; the adapter that was active keeps what it trained and the
gradients it has not stepped on yet. Activating the active adapter again copies nothing.
Every method is collective where the engine's parameters are sharded (``DTensor``): under
torchrun each rank calls it with the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tandemrl.engines.lora import PEFT_PREFIX, LoRALinear

Tensors = dict[str, torch.Tensor]


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (the whole tensor when it is not sharded)."""
    return p.to_local() if isinstance(p, DTensor) else p.data


def _shard_of(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as parameter ``p`` (``full`` is the same on every rank)."""
    full = full.to(device=_local(p).device, dtype=p.dtype)
    if isinstance(p, DTensor):  # split locally: every rank holds the whole tensor already
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A whole copy on the CPU (never a view of the live parameter or state)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


@dataclass
class Adapter:
    rank: int
    scaling: float
    targets: tuple[str, ...]  # module names (e.g. ``q_proj``) it adapts
    local: Tensors  # parameter name -> this rank's part, padded to the bank's rank
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)  # parameter name -> AdamW state
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)  # gradients waiting for its step


class AdapterBank:
    """Named adapters on ``model`` (its ``LoRALinear`` modules at ``max_rank``) trained by ``optimizer``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
        if not self.modules:
            raise ValueError("AdapterBank: the model has no LoRA modules (build the engine with lora.rank > 0)")
        self.params = {
            f"{n}.lora_{ab}.weight": getattr(m, f"lora_{ab}").weight for n, m in self.modules.items() for ab in "AB"
        }
        self.max_rank = int(next(iter(self.modules.values())).lora_A.weight.shape[0])
        self.adapters: dict[str, Adapter] = {}
        self.active: str | None = None

    # ------------------------------------------------------------------ adapters
    def add(self, name: str, rank: int, alpha: float, targets: tuple[str, ...], seed: int) -> None:
        """A new adapter: A drawn as ``nn.Linear`` draws it (Kaiming-uniform, from ``seed``), B zero."""
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"lora rank {rank} is outside 1..{self.max_rank} (the bank's largest rank)")
        gen = torch.Generator().manual_seed(seed)
        full: Tensors = {}
        for mod_name, mod in self.modules.items():
            a = torch.zeros(self.max_rank, mod.in_features)
            b = torch.zeros(mod.out_features, self.max_rank)
            if mod_name.rsplit(".", 1)[-1] in targets:
                bound = 1.0 / mod.in_features**0.5
                a[:rank] = (torch.rand(rank, mod.in_features, generator=gen) * 2 - 1) * bound
            full[f"{mod_name}.lora_A.weight"], full[f"{mod_name}.lora_B.weight"] = a, b
        local = {n: _shard_of(p, full[n]).clone() for n, p in self.params.items()}
        self.adapters[name] = Adapter(rank, alpha / rank, targets, local)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        if self.active == name:
            self.active = None

    def adapter(self, name: str) -> Adapter:
        if name not in self.adapters:
            raise KeyError(f"no adapter {name!r} in the bank")
        return self.adapters[name]

    def activate(self, name: str) -> Adapter:
        """Put adapter ``name`` into the model and the optimizer (see the module docstring)."""
        ad = self.adapter(name)
        if self.active == name:
            return ad
        state = cast(dict[Any, Any], self.optimizer.state)
        with torch.no_grad():
            if self.active is not None:  # the outgoing adapter keeps what it trained
                out = self.adapters[self.active]
                for n, p in self.params.items():
                    out.local[n].copy_(_local(p))
                    out.optim[n] = state.pop(p, {})
                    out.grads[n] = p.grad
            for n, p in self.params.items():
                _local(p).copy_(ad.local[n])
                state[p] = ad.optim.get(n, {})
                p.grad = ad.grads.pop(n, None)
        for mod_name, mod in self.modules.items():
            mod.scaling = ad.scaling if mod_name.rsplit(".", 1)[-1] in ad.targets else 0.0
        self.active = name
        return ad

    # ------------------------------------------------------------------ import/export (collective)
    def peft_tensors(self, name: str) -> Tensors:
        """The adapter's whole tensors at its own rank, under PEFT names of its target modules."""
        ad = self.activate(name)
        out: Tensors = {}
        for mod_name, mod in self.modules.items():
            if mod_name.rsplit(".", 1)[-1] not in ad.targets:
                continue
            out[f"{PEFT_PREFIX}{mod_name}.lora_A.weight"] = _whole(mod.lora_A.weight)[: ad.rank].contiguous()
            out[f"{PEFT_PREFIX}{mod_name}.lora_B.weight"] = _whole(mod.lora_B.weight)[:, : ad.rank].contiguous()
        return out

    def load_tensors(self, name: str, tensors: Tensors) -> None:
        """Set the adapter from whole tensors at its rank, keyed ``<module>.lora_{A,B}.weight``."""
        self.activate(name)
        with torch.no_grad():
            for n, p in self.params.items():
                if n not in tensors:
                    continue
                _local(p).copy_(_shard_of(p, _padded(n, tensors[n], p.shape)))

    def optimizer_state(self, name: str) -> dict[str, dict[str, torch.Tensor]]:
        """The adapter's AdamW state as whole tensors at its rank (empty before its first step)."""
        ad = self.activate(name)
        state = cast(dict[Any, Any], self.optimizer.state)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in self.params.items():
            s = state.get(p) or {}
            out[n] = {k: _padded_slice(n, _whole(v), ad.rank) if v.dim() else _whole(v) for k, v in s.items()}
        return out

    def load_optimizer_state(self, name: str, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore what :meth:`optimizer_state` returned (for an adapter of the same rank)."""
        self.activate(name)
        state = cast(dict[Any, Any], self.optimizer.state)
        for n, p in self.params.items():
            entry: dict[str, torch.Tensor] = {}
            for k, v in (saved.get(n) or {}).items():
                if v.dim() == 0:
                    entry[k] = v.clone()
                    continue
                shard = _shard_of(p, _padded(n, v, p.shape)).to(v.dtype)
                if isinstance(p, DTensor):
                    shard = DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                entry[k] = shard
            state[p] = entry


def _padded_slice(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """The first ``rank`` rows of an A-shaped tensor, columns of a B-shaped one (the inverse of ``_padded``)."""
    return (t[:rank] if name.endswith("lora_A.weight") else t[:, :rank]).contiguous()


def _padded(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` (an A- or B-shaped tensor at its own rank) in zeros of the bank's ``shape``."""
    full = torch.zeros(shape, dtype=t.dtype)
    if name.endswith("lora_A.weight"):
        full[: t.shape[0]] = t
    else:
        full[:, : t.shape[1]] = t
    return full
