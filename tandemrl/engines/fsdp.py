"""FSDP2 (``torch.distributed.fsdp.fully_shard``) backend over an HF causal LM.

Only what differs from the shared base lives here: building and sharding the model,
the packed forward, mesh-aware gradient clipping, and HF/DCP checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

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

from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.base import DTYPES, BaseTrainEngine, default_device, init_default_process_group
from tandemrl.engines.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict
from tandemrl.inference.types import ParamSpec
from tandemrl.models.varlen_attention import VARLEN_SDPA, register_varlen_attention


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
        norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq = total_sq.to(norm.device) + norm.float() ** 2
    total = total_sq.sqrt()
    if max_norm > 0 and torch.isfinite(total):
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def auto_model_class(is_critic: bool) -> type:
    """HF auto class of the engine's model: a causal LM, or a 1-label token classifier as critic."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    return AutoModelForTokenClassification if is_critic else AutoModelForCausalLM


class FSDPEngine(BaseTrainEngine):
    """An HF causal LM sharded with FSDP2 over a 1-D data-parallel mesh."""

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config)
        self._device = default_device()
        self.mesh: DeviceMesh | None = None
        self.parallel_strategy = ParallelStrategy()
        self.model_config = None

    # ------------------------------------------------------------ groups/ids
    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        init_default_process_group()
        world = dist.get_world_size()
        strategy = parallel_strategy or ParallelStrategy(dp=world)
        if strategy.tp != 1 or strategy.pp != 1 or strategy.ep != 1 or strategy.cp != 1:
            raise ValueError(f"FSDPEngine supports data parallelism only, got {strategy}")
        if strategy.dp != world:
            raise ValueError(f"allocation gives fsdp d={strategy.dp} but the torchrun world size is {world}")
        self.parallel_strategy = strategy
        self.mesh = init_device_mesh(self._device.type, (world,), mesh_dim_names=("dp",))

    @property
    def device(self) -> torch.device:
        return self._device

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
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        from transformers import AutoConfig

        if self.mesh is None:
            self.create_process_group()
        cfg = self.config
        if not cfg.path:
            raise ValueError("TrainEngineConfig.path: empty; set it to an HF model directory")
        if not os.path.isdir(cfg.path) and os.path.sep in cfg.path:
            raise FileNotFoundError(f"TrainEngineConfig.path: model directory not found: {cfg.path}")
        dtype = DTYPES[cfg.dtype]
        torch.manual_seed(cfg.seed)
        self.model_config = AutoConfig.from_pretrained(cfg.path)
        # Packed inputs need no KV cache: with a cache, HF does not detect packing from
        # position_ids and lets tokens attend across sequence boundaries.
        self.model_config.use_cache = False
        if cfg.is_critic:  # value head: one output per token, deterministic (no classifier dropout)
            self.model_config.num_labels = 1
            self.model_config.classifier_dropout = 0.0
        auto_cls = auto_model_class(cfg.is_critic)
        if cfg.attn_impl == VARLEN_SDPA:  # our per-sequence SDPA; HF must know the name before the build
            register_varlen_attention()
        if cfg.init_from_scratch:
            model = auto_cls.from_config(self.model_config, dtype=dtype, attn_implementation=cfg.attn_impl)
        else:
            model = auto_cls.from_pretrained(
                cfg.path, config=self.model_config, dtype=dtype, attn_implementation=cfg.attn_impl
            )
        model.to(self._device)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = None
        if cfg.mixed_precision:
            mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32)
        kwargs = {"mesh": self.mesh} if mp is None else {"mesh": self.mesh, "mp_policy": mp}
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)  # root keeps embeddings, final norm and lm_head
        self.model = model
        self.ft_spec = ft_spec
        self.build_optimizer(list(model.parameters()), ft_spec)
        self._initialized = True
        self.model.train()

    def destroy(self) -> None:
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self._initialized = False

    # ---------------------------------------------------------------- compute
    def _forward_logits(self, mb: TensorDict) -> torch.Tensor:
        varlen: dict[str, torch.Tensor | int] = {}
        if self.config.attn_impl == VARLEN_SDPA:  # sequence boundaries, so attention costs sum(len^2), not T^2
            cu, max_len = mb["cu_seqlens"], int(mb["max_seqlen"])
            varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
        out = self.model(
            input_ids=mb["input_ids"].unsqueeze(0),
            position_ids=mb["position_ids"].unsqueeze(0),
            use_cache=False,
            **varlen,
        )
        return out.logits.squeeze(0)

    def _optimizer_step(self) -> tuple[float, bool]:
        params = list(self.model.parameters())
        norm = float(clip_grad_norm_by_mesh(params, self.config.optimizer.gradient_clipping))
        stepped = bool(torch.isfinite(torch.tensor(norm)))
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    # ---------------------------------------------------------- weight export
    def hf_param_specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in self.model.state_dict().items()
        ]

    def iter_hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.state_dict().items():
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()

    # ----------------------------------------------------------- checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded CPU weights on rank 0 (empty dict on the other ranks)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def _save_hf(self, meta: SaveLoadMeta) -> None:
        from transformers import AutoTokenizer

        sd = self.full_state_dict()
        if dist.get_rank() == 0:
            os.makedirs(meta.path, exist_ok=True)
            with torch.device("meta"):
                fresh = auto_model_class(self.config.is_critic).from_config(
                    self.model_config, dtype=DTYPES[self.config.dtype]
                )
            fresh.load_state_dict(sd, assign=True)
            fresh.config.use_cache = True  # the exported model is for generation
            fresh.save_pretrained(meta.path, state_dict=sd)
            tok_path = meta.tokenizer_path or self.config.tokenizer_path or self.config.path
            if tok_path:
                AutoTokenizer.from_pretrained(tok_path).save_pretrained(meta.path)

    def _load_hf(self, meta: SaveLoadMeta) -> None:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(meta.path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {meta.path}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(os.path.join(meta.path, f)))
        if "lm_head.weight" not in sd and getattr(self.model_config, "tie_word_embeddings", False):
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        set_model_state_dict(self.model, sd, options=opts)

    def _save_recoverable(self, meta: SaveLoadMeta) -> None:
        msd, osd = get_state_dict(self.model, self.optimizer) if self.optimizer else (None, None)
        state = {"model": msd if msd is not None else get_model_state_dict(self.model)}
        if osd is not None and meta.with_optim:
            state["optim"] = osd
        dcp.save(state, checkpoint_id=meta.path)
        if dist.get_rank() == 0:
            extra = {"version": self._version}
            if self.lr_scheduler is not None:
                extra["lr_scheduler"] = self.lr_scheduler.state_dict()
            torch.save(extra, os.path.join(meta.path, "engine_state.pt"))
            with open(os.path.join(meta.path, "engine_meta.json"), "w") as f:
                json.dump({"with_optim": "optim" in state, "backend": "fsdp"}, f)

    def _load_recoverable(self, meta: SaveLoadMeta) -> None:
        with open(os.path.join(meta.path, "engine_meta.json")) as f:
            info = json.load(f)
        with_optim = info["with_optim"] and meta.with_optim and self.optimizer is not None
        if with_optim:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=meta.path)
        if with_optim:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        extra = torch.load(os.path.join(meta.path, "engine_state.pt"), weights_only=False)
        self._version = int(extra["version"])
        if self.lr_scheduler is not None and "lr_scheduler" in extra:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
