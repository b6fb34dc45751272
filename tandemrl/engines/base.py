"""Logic shared by every training backend: build and teardown order, micro-batching, packing, loss
weighting, optimizer and LR schedule, versioning, HF export and checkpoint bookkeeping.

Public methods hold the guards and the shared algorithm; a backend implements only the
``_hooks`` (process groups, build, forward on a packed micro-batch, backward, optimizer step,
full weights, its own checkpoint files) and the weight-export pair ``hf_param_specs``/``iter_hf_params``.

The LR schedule is stepped here, by the public updates, never by an algorithm or a loop: each call of
``train_batch`` (one optimizer step) or ``train_minibatches`` (one optimizer step per minibatch, e.g.
PPO's minibatches times epochs) is one trainer step; every optimizer step in it uses the same lr, and the
schedule advances once when the call ends. So the lr of global step ``k`` is ``lr * lr_lambda(k)``
whatever number of optimizer steps the algorithm takes in it, on every backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from abc import abstractmethod
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from tandemrl.api.engine import LossFn, LossWeightFn, PostHook, TrainBackend
from tandemrl.api.net import free_port
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict
from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
from tandemrl.engines.engine_state import load_engine_state, read_engine_meta, save_engine_state
from tandemrl.engines.hf_model import packed_logits, save_hf_dir
from tandemrl.engines.packing import MicroBatches, pack_groups, plan_chunks, plan_padded_batch, unpack_to_padded
from tandemrl.engines.prefix_sharing import (
    PREFIX_SHARING_MODES,
    Segment,
    add_shared_layout,
    segment_fields,
    sharing_segments,
)
from tandemrl.models.varlen_attention import VARLEN_SDPA
from tandemrl.utils import stats_tracker

logger = logging.getLogger(__name__)


def lr_lambda(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """LR multiplier per step: linear warmup from 0, then constant/linear/cosine decay."""
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    decay_steps = max(1, total_steps - warmup)
    floor = cfg.min_lr_ratio

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / decay_steps)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        if cfg.lr_scheduler_type == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        if cfg.lr_scheduler_type == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"optimizer.lr_scheduler_type: unknown schedule '{cfg.lr_scheduler_type}'")

    return fn


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_default_process_group() -> None:
    """Join the torchrun world (NCCL on GPUs, gloo on CPU); a single process gets a world of 1."""
    if dist.is_initialized():
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: never outlive the agent (see lifeline)
        from tandemrl.utils.lifeline import die_with_parent

        die_with_parent(f"trainer rank {os.environ.get('RANK', '?')}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        # Not under torchrun: a world of one, so the same code path runs in notebooks/tests.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Seconds a collective may wait; tests lower it so a hang fails fast.
    timeout = timedelta(seconds=int(os.environ.get("TANDEMRL_DIST_TIMEOUT", "1800")))
    dist.init_process_group(backend, timeout=timeout)


def data_parallel_only(strategy: ParallelStrategy | None, backend: str) -> ParallelStrategy:
    """Join the torchrun world and check a data-parallel-only allocation against its size."""
    init_default_process_group()
    world = dist.get_world_size()
    strategy = strategy or ParallelStrategy(dp=world)
    if strategy.tp != 1 or strategy.pp != 1 or strategy.ep != 1 or strategy.cp != 1:
        raise ValueError(f"the {backend} engine supports data parallelism only, got {strategy}")
    if strategy.dp != world:
        raise ValueError(f"allocation gives {backend} d={strategy.dp} but the torchrun world size is {world}")
    return strategy


def _filler_guard(group: list[int]) -> contextlib.AbstractContextManager[None]:
    """Filler micro-batches (empty group) only keep collectives aligned: record no stats."""
    return stats_tracker.muted() if not group else contextlib.nullcontext()


class BaseTrainEngine(TrainBackend):
    """Shared engine logic; backends subclass it and implement the ``_hooks``."""

    backend: ClassVar[str]  # names the backend in recoverable checkpoints (a checkpoint loads only into it)
    supports_prefix_sharing: ClassVar[bool] = True  # its _forward_logits runs the shared layout (hf_model)

    def __init__(self, config: TrainEngineConfig):
        if config.megatron.router_replay and "router_replay" not in self.features:
            raise ValueError(
                f"megatron.router_replay: MoE routing replay is Megatron-only, this is the {self.backend} engine"
            )
        if config.head_dtype not in (None, "float32"):
            raise ValueError(f"TrainEngineConfig.head_dtype: '{config.head_dtype}' (expected float32 or null)")
        if config.head_dtype is not None and "fp32_head" not in self.features:
            raise ValueError(
                f"TrainEngineConfig.head_dtype: not supported by the {self.backend} engine (FSDP2, DeepSpeed)"
            )
        self.config = config
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.ft_spec: FinetuneSpec | None = None
        self.parallel_strategy = ParallelStrategy()
        self.model_config: Any = None  # the HF config of the model, on every backend
        self._device = default_device()
        self._groups_ready = False  # set by create_process_group
        self._version = 0
        self._initialized = False

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _build_model(self, ft_spec: FinetuneSpec | None) -> torch.nn.Module:
        """The (sharded, wrapped) model to train; also builds ``self.optimizer`` and ``self.lr_scheduler``
        when ``config.optimizer`` is set. Process groups exist already."""

    def _release(self) -> None:
        """Free what the backend holds beyond model/optimizer/schedule (called by ``destroy``)."""

    def _forward_logits(self, mb: TensorDict) -> torch.Tensor:
        """Logits [T, V] of a packed micro-batch already on ``self.device`` (default: the HF model)."""
        return packed_logits(self.built_model, mb, self.config.attn_impl)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @abstractmethod
    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, step if the grad norm is finite, zero grads; returns (grad_norm, stepped)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full HF-named CPU weights on rank 0 (an empty dict on the other ranks)."""

    @abstractmethod
    def _load_hf(self, meta: SaveLoadMeta) -> None:
        """Collective: weights from the HF directory ``meta.path`` into the (sharded) model."""

    @abstractmethod
    def _save_checkpoint(self, meta: SaveLoadMeta) -> bool:
        """Collective: the backend's resumable files under ``meta.path``; returns whether they hold the optimizer."""

    @abstractmethod
    def _load_checkpoint(self, meta: SaveLoadMeta, with_optim: bool) -> None:
        """Collective: restore what ``_save_checkpoint`` wrote (the optimizer too when ``with_optim``)."""

    # ------------------------------------------------------------- utilities
    def _require_initialized(self, what: str) -> None:
        if not self._initialized:
            raise RuntimeError(f"{type(self).__name__}.{what}() called before initialize()")

    def build_optimizer(self, params: list[torch.nn.Parameter], ft_spec: FinetuneSpec | None) -> None:
        """AdamW and its LR schedule (sized from ``ft_spec``; constant if it is None)."""
        cfg = self.config.optimizer
        if cfg is None:
            return
        if cfg.type != "adamw":
            raise ValueError(f"optimizer.type: unknown optimizer '{cfg.type}' (expected 'adamw')")
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )
        total = ft_spec.total_train_steps if ft_spec is not None else 1
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total))

    def _to_device(self, mb: TensorDict) -> TensorDict:
        return {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}

    def _split(self, batch: TensorDict, granularity: int = 1) -> MicroBatches:
        """Micro-batches of this rank's batch; every DP rank gets the same count.

        With prefix sharing (``config.prefix_sharing``) rows sharing a prefix stay in one
        micro-batch, budgeted by their shared-layout tokens, and each micro-batch carries its
        shared layout (see :mod:`tandemrl.engines.prefix_sharing`).
        """
        spec = self.config.mb_spec
        segs = self._prefix_segments(batch)
        if segs is not None:
            batch = {**batch, **segment_fields(segs, batch["attention_mask"].device)}
            chunks, tokens = [range(s.start, s.end) for s in segs], [s.tokens for s in segs]
            plan = functools.partial(plan_chunks, chunks, tokens, max_tokens_per_mb=spec.max_tokens_per_mb)
        else:
            plan = functools.partial(
                plan_padded_batch, batch, max_tokens_per_mb=spec.max_tokens_per_mb, granularity=granularity
            )
        groups = plan(spec.n_mbs)
        n = len(groups)
        if dist.is_initialized() and self.data_parallel_world_size > 1:
            t = torch.tensor(n, device=self._reduce_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            if int(t) > n:
                # Rebalance this rank's tokens over the larger count before padding with dummies.
                groups = plan(int(t))
            n = int(t)
        mbs = pack_groups(batch, groups, n)
        if segs is not None:
            mbs.mbs = [add_shared_layout(mb) for mb in mbs.mbs]
        return mbs

    def _prefix_segments(self, batch: TensorDict) -> list[Segment] | None:
        """Prefix-sharing segments of ``batch`` when ``config.prefix_sharing`` turns sharing on for it, else None."""
        mode = self.config.prefix_sharing
        if mode not in PREFIX_SHARING_MODES:
            raise ValueError(f"prefix_sharing: '{mode}' is not one of {', '.join(PREFIX_SHARING_MODES)}")
        if mode == "off" or (mode == "auto" and not self.supports_prefix_sharing):
            return None
        if not self.supports_prefix_sharing:
            raise ValueError(f"prefix_sharing: the {self.backend} engine does not support 'on'; use 'off' or 'auto'")
        if self.config.attn_impl != VARLEN_SDPA:
            if mode == "auto":
                return None
            raise ValueError(f"prefix_sharing: 'on' needs attn_impl={VARLEN_SDPA}, got '{self.config.attn_impl}'")
        return sharing_segments(batch, mode, self.config.mb_spec.max_tokens_per_mb)

    @staticmethod
    def _weights(mbs: MicroBatches, loss_weight_fn: LossWeightFn) -> list[float]:
        return [float(loss_weight_fn(mb)) if g else 0.0 for mb, g in zip(mbs.mbs, mbs.groups, strict=True)]

    def _all_reduce_sum(self, value: float) -> float:
        t = torch.tensor(value, dtype=torch.float64, device=self._reduce_device())
        if dist.is_initialized() and self.data_parallel_world_size > 1:
            dist.all_reduce(t, group=self.data_parallel_group)
        return float(t.item())

    def _reduce_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _sync_device(self) -> None:
        """Wait for the device's queued kernels (CUDA); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------- micro-batch loops
    def _train_micro_batches(self, mbs: MicroBatches, weights: list[float], scale: float, loss_fn: LossFn) -> float:
        """Forward+backward every micro-batch, its loss weighted by ``w * scale``; returns sum(loss * w).

        Overridable as a whole: a pipeline-parallel backend runs its own schedule instead.
        """
        loss_sum = 0.0
        for mb, w, group in zip(mbs.mbs, weights, mbs.groups, strict=True):
            mb = self._to_device(mb)
            with _filler_guard(group):
                loss = loss_fn(self._forward_logits(mb), mb)
            self._backward(loss * (w * scale))
            loss_sum += float(loss.detach()) * w
        return loss_sum

    def _forward_micro_batches(
        self, mbs: MicroBatches, fn: Callable[[torch.Tensor, TensorDict], torch.Tensor]
    ) -> list[torch.Tensor]:
        """``fn(logits, mb)`` of every micro-batch (no grad), in order, on every rank."""
        outs = []
        for mb, group in zip(mbs.mbs, mbs.groups, strict=True):
            mb = self._to_device(mb)
            with _filler_guard(group):
                outs.append(fn(self._forward_logits(mb), mb))
        return outs

    # ----------------------------------------------------------- build/teardown
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def built_model(self) -> torch.nn.Module:
        """The model; a one-line error before ``initialize`` (or after ``destroy``)."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: no model (call initialize first)")
        return self.model

    @property
    def built_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer; a one-line error on an engine built without ``config.optimizer``."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: no optimizer (config.optimizer is unset: a frozen model)")
        return self.optimizer

    @property
    def model_path(self) -> str:
        return self.config.path

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Join the process groups if not done yet, build the model (and optimizer), enter train mode."""
        if not self._groups_ready:
            self.create_process_group()
        self.ft_spec = ft_spec
        self.model = self._build_model(ft_spec)
        self._initialized = True
        self.model.train()

    def destroy(self) -> None:
        """Drop the model, optimizer and schedule (process groups stay: see ``teardown``)."""
        self._release()
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self._initialized = False

    # --------------------------------------------------------------- public
    def train(self, mode: bool = True) -> BaseTrainEngine:
        self._require_initialized("train")
        assert self.model is not None
        self.model.train(mode)
        return self

    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One trainer step: one optimizer step (see :meth:`_update`), then the LR schedule advances one step."""
        self._require_trainable("train_batch")
        stats = self._update(batch, loss_fn, loss_weight_fn)
        self._advance_lr_schedule()
        return stats

    def train_minibatches(
        self, minibatches: Iterable[tuple[TensorDict, LossFn]], loss_weight_fn: LossWeightFn
    ) -> list[dict[str, float]]:
        """One trainer step of several optimizer steps (PPO's minibatches and epochs): one :meth:`_update` per
        ``(minibatch, loss_fn)`` in order, all at the schedule's current lr, then the schedule advances once.

        The LR schedule counts trainer steps, not optimizer steps: it is sized by ``ft_spec.total_train_steps``
        and every public update (this or :meth:`train_batch`) is one trainer step, so no algorithm or loop steps
        it. A skipped update (no trainable token, non-finite gradient) still ends its trainer step.
        """
        self._require_trainable("train_minibatches")
        stats = [self._update(mb, loss_fn, loss_weight_fn) for mb, loss_fn in minibatches]
        if not stats:
            raise ValueError("train_minibatches: no minibatch to train on (one trainer step needs at least one)")
        self._advance_lr_schedule()
        return stats

    def _require_trainable(self, what: str) -> None:
        self._require_initialized(what)
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}.{what}(): engine was built without an optimizer")

    def _advance_lr_schedule(self) -> None:
        """The end of a trainer step: the next one trains at the schedule's next lr."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _update(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step whose gradient does not depend on micro-batch or DP splits.

        Each micro-batch loss is weighted by ``loss_weight_fn(mb) / global_weight``; the
        global weight sums over all micro-batches of all DP ranks. Gradients are averaged
        over DP ranks by the backend, hence the extra ``dp_world_size`` factor. Records the
        times ``timeperf/<scope>/fwd_bwd`` and ``timeperf/<scope>/optimizer_step``.
        """
        assert self.optimizer is not None
        self.train()
        mbs = self._split(batch)
        weights = self._weights(mbs, loss_weight_fn)
        total = self._all_reduce_sum(sum(weights))
        if total <= 0:  # e.g. mask_no_eos with every response truncated: nothing to learn from
            logger.warning("train_batch: update skipped, no trainable token in the batch on any rank (loss weight 0)")
            lr = self.optimizer.param_groups[0]["lr"]
            stats = {"loss": 0.0, "grad_norm": 0.0, "update_successful": 0.0, "lr": lr, "n_mbs": 0.0}
            stats_tracker.scalar(**stats, skipped_empty=1.0, skipped_nonfinite=0.0)
            return stats
        with stats_tracker.record_timing("fwd_bwd"):
            loss_sum = self._train_micro_batches(mbs, weights, self.data_parallel_world_size / total, loss_fn)
            self._sync_device()  # kernels still queued belong to this timing, not the optimizer's
        with stats_tracker.record_timing("optimizer_step"):
            grad_norm, stepped = self._optimizer_step()
        lr = self.optimizer.param_groups[0]["lr"]  # after the step: Megatron's optimizer sets it there
        loss = self._all_reduce_sum(loss_sum) / total
        if not stepped:
            logger.warning(
                "train_batch: optimizer step skipped: gradient norm %s is not finite (loss %s); weights unchanged",
                grad_norm,
                loss,
            )
        stats = {"loss": loss, "grad_norm": grad_norm, "update_successful": float(stepped), "lr": lr}
        stats["n_mbs"] = float(len(mbs.mbs))
        stats_tracker.scalar(**stats, skipped_empty=0.0, skipped_nonfinite=float(not stepped))
        return stats

    def accumulate_gradients(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn, total_weight: float
    ) -> float:
        """Forward and backward of ``batch`` with no optimizer step: the gradient adds to what earlier calls left,
        and :meth:`apply_gradients` steps on the sum (Tinker's ``forward_backward`` then ``optim_step``).

        Each micro-batch's loss is weighted by ``loss_weight_fn(mb) / total_weight``, ``total_weight`` being the
        weight of this call's whole batch over every DP rank (the caller knows it: no collective asks).
        Returns this rank's ``sum(loss * weight)``.
        """
        self._require_trainable("accumulate_gradients")
        if total_weight <= 0:
            raise ValueError(f"accumulate_gradients: total_weight must be > 0, got {total_weight}")
        self.train()
        mbs = self._split(batch)
        weights = self._weights(mbs, loss_weight_fn)
        with stats_tracker.record_timing("fwd_bwd"):
            loss_sum = self._train_micro_batches(mbs, weights, self.data_parallel_world_size / total_weight, loss_fn)
            self._sync_device()
        return loss_sum

    def apply_gradients(self) -> dict[str, float]:
        """One optimizer step on the gradient :meth:`accumulate_gradients` left (then zeroed), then the LR schedule
        advances one step; ``grad_norm``, ``update_successful`` and ``lr``."""
        self._require_trainable("apply_gradients")
        assert self.optimizer is not None
        with stats_tracker.record_timing("optimizer_step"):
            grad_norm, stepped = self._optimizer_step()
        lr = self.optimizer.param_groups[0]["lr"]
        if not stepped:
            logger.warning("apply_gradients: optimizer step skipped: gradient norm %s is not finite", grad_norm)
        self._advance_lr_schedule()
        return {"grad_norm": grad_norm, "update_successful": float(stepped), "lr": lr}

    def set_optimizer_params(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, gradient_clipping: float
    ) -> None:
        """AdamW's parameters for the next steps (a caller that sends them with every step, as the Tinker API does):
        every parameter group's, the gradient-clipping norm (0: none), and a constant schedule at ``lr``."""
        self._require_trainable("set_optimizer_params")
        assert self.optimizer is not None and self.config.optimizer is not None
        self.config.optimizer.gradient_clipping = float(gradient_clipping)
        groups = self.optimizer.param_groups
        for group in groups:
            group.update(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps))
            group["weight_decay"] = float(weight_decay)
        schedule = self.lr_scheduler
        if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):  # megatron's holds a parameter group of its own
            schedule.base_lrs = [float(lr)] * len(schedule.base_lrs)
            schedule.lr_lambdas = [lambda _step: 1.0 for _ in schedule.lr_lambdas]
            for group in schedule.optimizer.param_groups:
                group["lr"] = float(lr)
        elif schedule is not None:
            raise TypeError(f"set_optimizer_params: cannot hold the LR of a {type(schedule).__name__} schedule")

    @torch.no_grad()
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> torch.Tensor:
        self._require_initialized("eval_batch")
        self.eval()
        mbs = self._split(batch)
        weights = self._weights(mbs, loss_weight_fn)
        losses = self._forward_micro_batches(mbs, lambda logits, mb: loss_fn(logits, mb).detach().reshape(()))
        loss_sum = sum(float(loss) * w for loss, w in zip(losses, weights, strict=True))
        total = self._all_reduce_sum(sum(weights))
        return torch.tensor(self._all_reduce_sum(loss_sum) / max(total, 1e-12))

    @torch.no_grad()
    def forward(
        self,
        batch: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: PostHook | None = None,
        aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Per-token outputs in the input's padded [B, L, ...] layout, on the input's device.

        The device follows ``batch`` (not the engine), so outputs sit next to the batch's other
        fields: on GPU, ``compute_advantages`` combines a CPU rollout batch's masks and rewards
        with ``values`` and ``ref_logp`` from ``forward``, which would otherwise be on CUDA.
        ``post_hook(logits, mb)`` maps each micro-batch's logits to what is kept (e.g.
        next-token logprobs) so full logits never accumulate. With ``output_seqlens``
        the result is packed instead: sequences concatenated in input order.
        ``aggregate_fn`` replaces the default reassembly entirely.
        """
        self._require_initialized("forward")
        self.eval()
        mbs = self._split(batch)
        outs = self._forward_micro_batches(mbs, post_hook if post_hook is not None else lambda logits, mb: logits)
        if aggregate_fn is not None:
            return aggregate_fn([o for o, g in zip(outs, mbs.groups, strict=True) if g])
        padded = unpack_to_padded(outs, mbs, batch["attention_mask"]).to(batch["attention_mask"].device)
        if output_seqlens is None:
            return padded
        lens = batch["attention_mask"].bool().sum(1).tolist()
        if list(output_seqlens) != lens:
            raise ValueError(f"forward: output_seqlens {list(output_seqlens)} do not match batch lengths {lens}")
        return padded[batch["attention_mask"].bool().to(padded.device)]

    def save(self, meta: SaveLoadMeta) -> None:
        """Collective: every rank calls it. "hf" exports weights, "dcp" saves everything to resume."""
        self._require_initialized("save")
        if meta.weight_format == "hf":
            self._save_hf(meta)
        elif meta.weight_format == "dcp":
            self._save_recoverable(meta)
        elif meta.weight_format == "peft":
            self._save_adapter(meta)
        else:
            raise ValueError(f"SaveLoadMeta.weight_format: unknown format '{meta.weight_format}' (hf, dcp or peft)")
        if dist.is_initialized():
            dist.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        self._require_initialized("load")
        if not os.path.exists(meta.path):
            raise FileNotFoundError(f"checkpoint path does not exist: {meta.path}")
        if meta.weight_format == "hf":
            self._load_hf(meta)
        elif meta.weight_format == "dcp":
            self._load_recoverable(meta)
        else:
            raise ValueError(f"SaveLoadMeta.weight_format: unknown format '{meta.weight_format}' (hf or dcp)")

    @property
    def lora_rank(self) -> int:
        """Rank of the trained LoRA adapters; 0 when every weight is trained."""
        return self.config.lora.rank

    @property
    def lora_serve(self) -> str:
        return self.config.lora.serve

    def _save_adapter(self, meta: SaveLoadMeta) -> None:
        """Collective: the LoRA adapter as a PEFT directory (backends with LoRA override it)."""
        raise ValueError(f"SaveLoadMeta.weight_format='peft': the {self.backend} engine trains no LoRA adapter")

    def _save_hf(self, meta: SaveLoadMeta) -> None:
        sd = self.full_state_dict()
        if dist.get_rank() == 0:
            save_hf_dir(sd, self.model_config, self.config, meta)

    def _save_recoverable(self, meta: SaveLoadMeta) -> None:
        """The backend's files, then (once they are complete on every rank) version and LR schedule."""
        with_optim = self._save_checkpoint(meta)
        dist.barrier()
        if dist.get_rank() == 0:
            save_engine_state(meta.path, self.backend, self._version, self.lr_scheduler, with_optim=with_optim)

    def _load_recoverable(self, meta: SaveLoadMeta) -> None:
        info = read_engine_meta(meta.path, self.backend)
        with_optim = bool(info["with_optim"]) and meta.with_optim and self.optimizer is not None
        self._load_checkpoint(meta, with_optim)
        self._version = load_engine_state(meta.path, self.lr_scheduler)

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def is_data_parallel_head(self) -> bool:
        """The first rank of this rank's model-parallel group: one per DP replica, every rank without TP/PP."""
        return self._is_model_parallel_head()

    def _is_model_parallel_head(self) -> bool:
        """Overridden by backends with TP/PP: only one rank per DP replica is the head."""
        return True

    def export_stats(self) -> dict[str, float]:
        return stats_tracker.export_all(reduce_group=self.data_parallel_group)

    # --------------------------------------------------------- rollout hooks
    def broadcast_in_model_parallel_group(self, batch: TensorDict | None) -> TensorDict:
        """Without TP/PP every rank is its replica's head: its own batch, unchanged."""
        assert batch is not None
        return batch
