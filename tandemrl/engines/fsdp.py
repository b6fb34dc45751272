"""FSDP2 (``torch.distributed.fsdp.fully_shard``) backend over an HF causal LM.

Only what differs from the shared base lives here: building and sharding the model,
the packed forward, mesh-aware gradient clipping, and HF/DCP checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tandemrl.api.inference import ParamSpec
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.base import BaseTrainEngine, data_parallel_only
from tandemrl.engines.hf_model import build_hf_model, read_hf_state_dict
from tandemrl.engines.lora import adapter_items, apply_lora, is_adapter_key, merged_items, write_adapter
from tandemrl.engines.precision import resolve_precision
from tandemrl.engines.teardown import register_group_releaser


def clip_grad_norm_by_mesh(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm (and clipping) over parameters that may live on different meshes.

    ``torch.nn.utils.clip_grad_norm_`` cannot stack norms of DTensors from different
    meshes (or mix DTensors with plain tensors), so norms are reduced per mesh first.
    ``max_norm <= 0`` only measures.
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    total_sq = torch.zeros((), dtype=torch.float32)
    for ps in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None], 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq = total_sq.to(norm.device) + norm.float() ** 2
    total = total_sq.sqrt()
    if max_norm > 0 and torch.isfinite(total):
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) state-dict entry; collective for a DTensor."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches keep specs, hence device meshes and their process groups."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


class FSDPEngine(BaseTrainEngine):
    """An HF causal LM sharded with FSDP2 over a 1-D data-parallel mesh."""

    parallel_dims = "dtc"  # allocation_mode dims it trains with: data, tensor, context
    features = frozenset({"lora", "fp32_head"})

    backend = "fsdp"

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config)
        self.mesh: DeviceMesh | None = None

    # ------------------------------------------------------------ groups/ids
    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        self.parallel_strategy = data_parallel_only(parallel_strategy, "fsdp")
        world = dist.get_world_size()
        self.mesh = init_device_mesh(self._device.type, (world,), mesh_dim_names=("dp",))
        register_group_releaser(_clear_dtensor_caches)
        self._groups_ready = True

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank(self.data_parallel_group) if self.mesh is not None else 0

    @property
    def data_parallel_world_size(self) -> int:
        return self.mesh.size() if self.mesh is not None else 1

    # ------------------------------------------------------------------ build
    def _build_model(self, ft_spec: FinetuneSpec | None) -> torch.nn.Module:
        cfg = self.config
        precision = resolve_precision(cfg)
        model, self.model_config = build_hf_model(cfg, self._device)
        if cfg.lora.rank > 0:  # before sharding: each layer's unit holds its frozen base and its adapters
            apply_lora(model, cfg.lora)
        kwargs: dict = {"mesh": self.mesh}
        if precision.mixed:  # sharded fp32 master weights; 16-bit gathered copies; fp32 gradient reduction
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.weights)
        for layer in model.get_submodule("model.layers").children():
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)  # root keeps embeddings, final norm and lm_head
        self.build_optimizer([p for p in model.parameters() if p.requires_grad], ft_spec)
        return model

    # ---------------------------------------------------------------- compute
    def _optimizer_step(self) -> tuple[float, bool]:
        params = list(self.built_model.parameters())
        assert self.config.optimizer is not None  # an engine steps only with an optimizer
        norm = float(clip_grad_norm_by_mesh(params, self.config.optimizer.gradient_clipping))
        stepped = bool(torch.isfinite(torch.tensor(norm)))
        if stepped:
            self.built_optimizer.step()
        self.built_optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    # ---------------------------------------------------------- weight export
    def hf_param_specs(self) -> list[ParamSpec]:
        """HF names of the (merged, with LoRA) model: adapter tensors are folded into their base weights."""
        return [
            ParamSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in self.built_model.state_dict().items()
            if not is_adapter_key(name)
        ]

    def iter_hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from merged_items(self.built_model.state_dict(), self._lora_scaling, _full)

    @property
    def _lora_scaling(self) -> float:
        lora = self.config.lora
        return lora.alpha / lora.rank if lora.rank > 0 else 0.0

    # ----------------------------------------------------------- checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded CPU weights on rank 0 (empty dict on the other ranks); LoRA merged in."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = cast(dict[str, torch.Tensor], get_model_state_dict(self.built_model, options=opts))  # full: tensors
        return dict(merged_items(sd, self._lora_scaling)) if self.config.lora.rank > 0 else sd

    def _save_adapter(self, meta: SaveLoadMeta) -> None:
        """Collective: the LoRA adapter as a PEFT directory, written by rank 0."""
        if self.config.lora.rank <= 0:
            raise ValueError("SaveLoadMeta.weight_format='peft' needs lora.rank > 0 (this engine has no adapter)")
        tensors = {name: _full(t).cpu() for name, t in adapter_items(self.built_model.state_dict())}
        if dist.get_rank() == 0:
            write_adapter(meta.path, tensors, self.config.lora, self.config.path)

    def _load_hf(self, meta: SaveLoadMeta) -> None:
        sd = read_hf_state_dict(meta.path, self.model_config)
        # With LoRA an HF directory holds base weights only; the adapters keep their values.
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, strict=self.config.lora.rank <= 0)
        set_model_state_dict(self.built_model, cast(dict[str, Any], sd), options=opts)

    def _save_checkpoint(self, meta: SaveLoadMeta) -> bool:
        """A torch DCP checkpoint of the sharded model (and optimizer)."""
        msd, osd = get_state_dict(self.built_model, self.optimizer) if self.optimizer else (None, None)
        state: dict[str, Any] = {"model": msd if msd is not None else get_model_state_dict(self.built_model)}
        if osd is not None and meta.with_optim:
            state["optim"] = osd
        dcp.save(state, checkpoint_id=meta.path)
        return "optim" in state

    def _load_checkpoint(self, meta: SaveLoadMeta, with_optim: bool) -> None:
        state: dict[str, Any]
        if with_optim:
            msd, osd = get_state_dict(self.built_model, self.built_optimizer)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_model_state_dict(self.built_model)}
        dcp.load(state, checkpoint_id=meta.path)
        if with_optim:
            set_state_dict(
                self.built_model, self.built_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            set_model_state_dict(self.built_model, state["model"])
