"""DeepSpeed ZeRO (stages 1, 2, 3) backend over an HF causal LM.

Only what differs from the shared base lives here: the DeepSpeed config (a user's JSON merged
under what the engine must own), backward/step through the DeepSpeed engine, and gathering
ZeRO-3 partitions for HF export, weight updates and loading. Micro-batching, loss weighting,
the optimizer (torch AdamW) and its LR schedule come from the base, so an update equals plain
torch on the union of the ranks' data: each micro-batch's backward only accumulates, the
one ``step()`` per batch is the accumulation boundary (``managed_gradient_accumulation: false``)
and DeepSpeed's average over data-parallel ranks is undone by the base's ``dp_world_size`` factor.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.api.inference import ParamSpec
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.base import BaseTrainEngine, data_parallel_only
from tandemrl.engines.hf_model import build_hf_model, read_hf_state_dict
from tandemrl.engines.precision import resolve_precision
from tandemrl.engines.teardown import drop_module_groups, register_group_releaser

logger = logging.getLogger(__name__)

CKPT_TAG = "engine"  # one DeepSpeed tag per checkpoint directory: the directory is the checkpoint

# Keys of a DeepSpeed config that follow from TrainEngineConfig; a user's values are replaced.
_OWNED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    "gradient_clipping",
    "optimizer",
    "scheduler",
)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; nested dicts merge key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _drop_auto(d: dict[str, Any]) -> dict[str, Any]:
    """Remove HF-Trainer style ``"auto"`` placeholders so DeepSpeed's defaults apply."""
    return {k: _drop_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}


def deepspeed_config(cfg: TrainEngineConfig, dp_world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict: ``cfg.deepspeed.config_path`` < ``.extra`` < what the engine owns."""
    ds = cfg.deepspeed
    if ds.zero_stage not in (1, 2, 3):
        raise ValueError(f"deepspeed.zero_stage: must be 1, 2 or 3, got {ds.zero_stage}")
    if ds.offload_params and ds.zero_stage != 3:
        raise ValueError(f"deepspeed.offload_params: parameter offload needs zero_stage 3, got {ds.zero_stage}")
    user: dict[str, Any] = {}
    if ds.config_path:
        try:
            with open(ds.config_path) as f:
                user = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"deepspeed.config_path: file not found: {ds.config_path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"deepspeed.config_path: {ds.config_path} is not valid JSON ({e})") from None
        if not isinstance(user, dict):
            raise ValueError(f"deepspeed.config_path: {ds.config_path} must hold a JSON object")
    user = _drop_auto(_merge(user, dict(ds.extra)))

    compute = resolve_precision(cfg).compute
    clip = cfg.optimizer.gradient_clipping if cfg.optimizer is not None else 0.0
    zero = dict(user.get("zero_optimization", {}))
    owned: dict[str, Any] = {
        # One packed row per micro-batch; the base decides how many and weights their losses.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dp_world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max(clip, 0.0),
        "bf16": {**user.get("bf16", {}), "enabled": compute == torch.bfloat16},
        "fp16": {**user.get("fp16", {}), "enabled": compute == torch.float16},
    }
    for key in _OWNED_KEYS:
        if key in user and user[key] != owned.get(key):
            logger.warning(
                "deepspeed config: '%s' is set by the engine (TrainEngineConfig); ignoring %r", key, user[key]
            )
    if "stage" in zero and zero["stage"] != ds.zero_stage:
        logger.warning("deepspeed config: zero_optimization.stage comes from deepspeed.zero_stage=%d", ds.zero_stage)
    # A forward-only engine has no optimizer states or gradients to shard: stages 1/2 become 0.
    zero["stage"] = ds.zero_stage if cfg.optimizer is not None or ds.zero_stage == 3 else 0
    if ds.zero_stage == 1:  # overlap_comm with manual accumulation boundaries needs stage >= 2
        zero["overlap_comm"] = False
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
    if compute != torch.float32:  # 16-bit compute; gradients accumulate and reduce in fp32 unless the user says
        user = _merge({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}, user)
    out = {k: v for k, v in user.items() if k not in _OWNED_KEYS}
    out.update(owned)
    out["zero_optimization"] = zero
    out.setdefault("steps_per_print", 2**62)  # we log our own stats
    if ds.offload_optimizer:
        out["zero_force_ds_cpu_optimizer"] = False  # the base's torch AdamW steps the offloaded states
    return out


def _skip_cpu_op_builds() -> None:
    """CPU only: skip DeepSpeed's JIT build of the shared-memory all-reduce op (~3 min of g++).

    The op only serves inference all-reduce (AutoTP inference), never training. DeepSpeed's
    comm backend asks ``deepspeed.ops.__compatible_ops__`` whether it may build it; an empty
    table answers no. Leave GPU machines alone.
    """
    import deepspeed.ops

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__ = {}


class DeepSpeedEngine(BaseTrainEngine):
    """An HF causal LM trained with DeepSpeed ZeRO over all ranks as one data-parallel group."""

    parallel_dims = "dtc"  # allocation_mode dims it trains with: data, tensor, context
    features = frozenset({"fp32_head"})

    backend = "deepspeed"
    model: Any  # a deepspeed.DeepSpeedEngine wrapping the HF model (untyped); None before initialize

    # ------------------------------------------------------------ groups/ids
    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        import deepspeed

        self.parallel_strategy = data_parallel_only(parallel_strategy, "deepspeed")
        _skip_cpu_op_builds()
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the existing default group
        register_group_releaser(_drop_deepspeed_groups)
        self._groups_ready = True

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if self._groups_ready else None

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank() if self._groups_ready else 0

    @property
    def data_parallel_world_size(self) -> int:
        return dist.get_world_size() if self._groups_ready else 1

    @property
    def zero_stage(self) -> int:
        return self.config.deepspeed.zero_stage

    # ------------------------------------------------------------------ build
    def _build_model(self, ft_spec: FinetuneSpec | None) -> torch.nn.Module:
        import deepspeed

        ds_config = deepspeed_config(self.config, self.data_parallel_world_size)
        model, self.model_config = build_hf_model(self.config, self._device)
        # The base's AdamW + LambdaLR: DeepSpeed steps this optimizer on its (sharded) fp32
        # partitions, reusing its param_groups, so the schedule's lr reaches every step.
        self.build_optimizer(list(model.parameters()), ft_spec)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=ds_config)
        return engine

    def _release(self) -> None:
        if self.model is not None:
            _forget_zero3_module(self.model.module)
            self.model.destroy()

    # ---------------------------------------------------------------- compute
    def _backward(self, loss: torch.Tensor) -> None:
        # The base already weighted the loss for this micro-batch: no 1/GAS scaling.
        self.model.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple[float, bool]:
        """Reduce, clip, step (skipped by DeepSpeed on a non-finite norm) and zero grads."""
        self.model.step()
        norm = self.model.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return norm, bool(self.model.was_step_applied())

    # ---------------------------------------------------------- weight access
    def _named_hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """HF state-dict entries in state-dict order (tied weights under both names), unsharded or not."""
        return list(self.model.module.state_dict(keep_vars=True).items())

    def _gathered(self, params: list[torch.Tensor], modifier_rank: int | None = None) -> Any:
        """Full parameters inside the context (ZeRO-3 gathers them; stages 1/2 already hold them)."""
        import deepspeed

        params = list({id(p): p for p in params if hasattr(p, "ds_id")}.values())  # tied weights appear twice
        if self.zero_stage != 3 or not params:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    def _buckets(self, entries: list[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Consecutive entries of at most ``param_gather_bucket_mb`` (one entry may exceed it)."""
        limit = self.config.deepspeed.param_gather_bucket_mb << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in entries:
            nbytes = _full_numel(t) * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    def hf_param_specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(name, _full_shape(t), str(t.dtype).removeprefix("torch.")) for name, t in self._named_hf_tensors()
        ]

    def iter_hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ZeRO-3 gathers one bucket of partitions at a time; yields copies that outlive it."""
        for bucket in self._buckets(self._named_hf_tensors()):
            with self._gathered([t for _, t in bucket]):
                for name, t in bucket:
                    yield name, (t.detach().clone() if self.zero_stage == 3 else t.detach())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded CPU weights on rank 0 (empty dict on the other ranks)."""
        if self.zero_stage == 3:
            sd = self.model._zero3_consolidated_16bit_state_dict()  # gathers layer by layer
            return dict(sd) if sd is not None else {}
        if dist.get_rank() != 0:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.model.module.state_dict().items()}

    # ----------------------------------------------------------- checkpoints
    def _load_hf(self, meta: SaveLoadMeta) -> None:
        sd = read_hf_state_dict(meta.path, self.model_config)
        entries: list[tuple[str, torch.Tensor]] = [
            (n, t) for n, t in self._named_hf_tensors() if isinstance(t, torch.nn.Parameter)
        ]
        missing = [n for n, _ in entries if n not in sd]
        if missing:
            raise KeyError(f"HF checkpoint {meta.path} has no '{missing[0]}' ({len(missing)} weights missing)")
        for bucket in self._buckets(entries):
            with self._gathered([t for _, t in bucket], modifier_rank=0), torch.no_grad():
                for name, p in bucket:  # ZeRO-3: rank 0's copy is scattered when the context exits
                    p.data.copy_(sd[name].to(device=p.device, dtype=p.dtype))
        optimizer = self.model.optimizer
        if hasattr(optimizer, "refresh_fp32_params"):  # the fp32 master partitions follow the weights
            optimizer.refresh_fp32_params()

    def _save_checkpoint(self, meta: SaveLoadMeta) -> bool:
        """DeepSpeed's own sharded checkpoint: weights and optimizer, always both."""
        if self.optimizer is None and self.zero_stage == 3:
            raise ValueError("a forward-only ZeRO-3 engine has no recoverable state; save it with weight_format='hf'")
        self.model.save_checkpoint(meta.path, tag=CKPT_TAG, save_latest=False)
        return self.optimizer is not None

    def _load_checkpoint(self, meta: SaveLoadMeta, with_optim: bool) -> None:
        # Without optimizer states DeepSpeed still restores the fp32 master weights (Adam state stays fresh).
        path, _ = self.model.load_checkpoint(
            meta.path, tag=CKPT_TAG, load_optimizer_states=with_optim, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag '{CKPT_TAG}') under {meta.path}")


def _forget_zero3_module(module: torch.nn.Module) -> None:
    """ZeRO-3 pushes each model on a module-level stack at init and never pops it: without this the
    engine, its parameters and its process groups stay alive for the rest of the process."""
    from deepspeed.runtime.zero import parameter_offload

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]


def _drop_deepspeed_groups() -> None:
    """DeepSpeed keeps a clone of the world group (and expert groups) in module globals, and its
    communication backend object holds the world group."""
    from deepspeed import comm
    from deepspeed.utils import groups

    drop_module_groups(groups)
    comm.comm.cdb = None  # rebuilt by the next deepspeed.init_distributed()


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """Unpartitioned shape: ZeRO-3 parameters keep it in ``ds_shape``."""
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)


def _full_numel(t: torch.Tensor) -> int:
    return int(t.ds_numel) if hasattr(t, "ds_numel") else t.numel()
