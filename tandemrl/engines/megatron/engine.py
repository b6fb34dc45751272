"""Megatron-core backend: GPTModel with tensor, pipeline, data and expert parallelism.

Only what differs from the shared base lives here: parallel groups from the allocation's
ParallelStrategy, the GPTModel built from the HF config (model.py) and loaded from HF safetensors
(hf_convert.py), Megatron DDP + ``get_megatron_optimizer`` stepped with the base's LR schedule,
the packed forward (one row, block-diagonal causal mask), a pipeline schedule for PP > 1, and
checkpoints. The loss contract is the base's: ``loss_fn(logits [T, V], mb)`` on full-vocab logits.
A critic (``is_critic``) is the same GPTModel with a value head in place of the LM head (value_head.py),
HF's ``<Arch>ForTokenClassification`` with one label: its "logits" are the values [T, 1].

Recoverable ("dcp") checkpoints are megatron-core dist checkpoints (checkpoint.py: sharded weights and
layout-free optimizer state), so they resume on another DP/TP/PP layout; HF exports are layout-free.

Gradient scale: Megatron DDP averages gradients over the data-parallel group (expert gradients
too: their expert-DP reduction is scaled to the same ``1/dp``), exactly what the base's
``dp_world_size / total`` loss weight undoes, as under FSDP.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.api.engine import LossFn, PostHook
from tandemrl.api.inference import ParamSpec
from tandemrl.api.types import ROUTED_EXPERTS, FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.base import BaseTrainEngine, _filler_guard, init_default_process_group
from tandemrl.engines.hf_model import load_model_config
from tandemrl.engines.packing import MicroBatches
from tandemrl.engines.precision import resolve_precision
from tandemrl.engines.teardown import register_group_releaser

_LIVE_ENGINES = 0  # megatron's parallel_state is process-global: engines of one process share it


def _init_parallel_state(s: ParallelStrategy, timeout_minutes: int) -> None:
    """(Re)build megatron's process-global groups for ``s``; refuse to change them under a live engine."""
    from megatron.core import parallel_state as ps

    want = (s.tp, s.pp, s.ep, s.etp)
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have == want:
            return
        if _LIVE_ENGINES:
            raise ValueError(f"megatron engines in one process must share a layout: have (t,p,e,etp)={have}, got {s}")
        ps.destroy_model_parallel()
    register_group_releaser(ps.destroy_model_parallel)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        expert_model_parallel_size=s.ep,
        expert_tensor_parallel_size=s.etp,
        distributed_timeout_minutes=timeout_minutes,
    )


class MegatronEngine(BaseTrainEngine):
    """An HF-architecture causal LM trained as a megatron-core GPTModel."""

    parallel_dims = "dtpce"  # allocation_mode dims it trains with: data, tensor, pipeline, context, expert
    moe_hybrid = True  # takes megatron:(attn:...|ffn:...): separate attention and expert layouts
    features = frozenset({"router_replay"})

    backend = "megatron"
    supports_prefix_sharing = False  # the GPTModel forward takes no per-block attention layout
    model: Any  # megatron-core's DistributedDataParallel around a GPTModel (untyped); None before initialize
    optimizer: Any  # megatron-core's (chained, distributed) optimizer (untyped); None without config.optimizer

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config)
        self.tf_config: Any = None
        self._lr_holder: torch.optim.Optimizer | None = None
        self._routers: Any = None  # routing.RouterSwitch with megatron.router_replay
        self._recorded: list[torch.Tensor] | None = None  # routings recorded by forward(), per micro-batch

    # ------------------------------------------------------------ groups/ids
    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        from tandemrl.engines.megatron.cpu_shims import apply_cpu_shims

        init_default_process_group()
        apply_cpu_shims()  # no-op with CUDA
        world = dist.get_world_size()
        s = parallel_strategy or ParallelStrategy(dp=world)
        if s.cp != 1:
            raise ValueError(f"allocation_mode: the megatron engine does not support context parallelism yet, got {s}")
        if s.world_size != world:
            raise ValueError(f"allocation gives megatron {s} ({s.world_size} ranks) but the torchrun world is {world}")
        _init_parallel_state(s, int(os.environ.get("TANDEMRL_DIST_TIMEOUT", "1800")) // 60 or 1)
        self.parallel_strategy = s
        self._groups_ready = True

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group() if self._groups_ready else None

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank() if self._groups_ready else 0

    @property
    def data_parallel_world_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size() if self._groups_ready else 1

    def _model_parallel_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()  # tp x pp ranks of one DP replica

    def _is_model_parallel_head(self) -> bool:
        return dist.get_rank(self._model_parallel_group()) == 0

    def broadcast_in_model_parallel_group(self, batch: TensorDict | None) -> TensorDict:
        """The replica head's batch to its TP/PP peers (they produced none)."""
        group = self._model_parallel_group()
        if dist.get_world_size(group) == 1:
            assert batch is not None
            return batch
        box: list[TensorDict | None] = [batch]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        assert box[0] is not None  # the head's batch
        return box[0]

    @property
    def _pp(self) -> int:
        return self.parallel_strategy.pp

    # ------------------------------------------------------------------ build
    def _build_model(self, ft_spec: FinetuneSpec | None) -> torch.nn.Module:
        global _LIVE_ENGINES
        from megatron.core import tensor_parallel

        from tandemrl.engines.megatron.hf_convert import load_hf_weights
        from tandemrl.engines.megatron.model import build_gpt_model, transformer_config_from_hf
        from tandemrl.engines.megatron.value_head import install_value_head

        cfg = self.config
        if cfg.gradient_checkpointing:
            raise ValueError("TrainEngineConfig.gradient_checkpointing: not supported by the megatron engine yet")
        s = self.parallel_strategy
        self.model_config = load_model_config(cfg)
        # 16-bit model parameters; the optimizer keeps fp32 main copies (see precision.py)
        dtype = resolve_precision(cfg).compute
        self.tf_config = transformer_config_from_hf(self.model_config, tp=s.tp, pp=s.pp, ep=s.ep, params_dtype=dtype)
        # The allocation's expert TP (1 unless the hybrid attn|ffn form says otherwise); megatron's
        # config would default it to the attention TP, disagreeing with the groups built above.
        self.tf_config.expert_tensor_parallel_size = s.etp
        self._check_router_replay()
        self.tf_config.moe_enable_routing_replay = cfg.megatron.router_replay
        torch.manual_seed(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        build_config = self.model_config
        if cfg.is_critic:  # the value head replaces the output layer: it must not be the embedding
            build_config = copy.copy(self.model_config)  # the exported config keeps the original flag
            build_config.tie_word_embeddings = False
        model = build_gpt_model(build_config, self.tf_config)
        if cfg.is_critic:
            install_value_head(model, self.model_config, self.tf_config, cfg.seed)
        if not cfg.init_from_scratch:
            load_hf_weights(model, cfg.path, self.model_config, critic=cfg.is_critic, seed=cfg.seed)
        if cfg.megatron.router_replay:
            from tandemrl.engines.megatron.routing import RouterSwitch

            hf = self.model_config
            n_layers, k = hf.num_hidden_layers, hf.num_experts_per_tok
            self._routers = RouterSwitch(model, n_layers, hf.num_experts, k)
        if cfg.optimizer is not None:
            model = self._wrap_and_build_optimizer(model, ft_spec)
        _LIVE_ENGINES += 1
        return model

    def _check_router_replay(self) -> None:
        from tandemrl.engines.megatron.model import is_moe

        if not self.config.megatron.router_replay:
            return
        if not is_moe(self.model_config):
            raise ValueError(f"megatron.router_replay: {self.config.path} is not an MoE model (nothing to replay)")
        if self.config.is_critic:
            raise ValueError("megatron.router_replay: replays an actor's sampled routing; a critic routes freely")
        s = self.parallel_strategy
        if s.tp != 1 or s.pp != 1:
            raise ValueError(
                f"megatron.router_replay: supported with tp=1 and pp=1 for now (data/expert parallel), got {s}"
            )

    def _wrap_and_build_optimizer(self, model: torch.nn.Module, ft_spec: FinetuneSpec | None) -> torch.nn.Module:
        """Megatron DDP + (distributed) Adam with our AdamW settings; LR comes from our schedule each step."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        from tandemrl.engines.base import lr_lambda

        cfg, opt = self.config, self.config.optimizer
        assert opt is not None
        compute = resolve_precision(cfg).compute
        if opt.type != "adamw":
            raise ValueError(f"optimizer.type: unknown optimizer '{opt.type}' (expected 'adamw')")
        dist_opt = self.config.megatron.use_distributed_optimizer
        ddp = DistributedDataParallel(
            self.tf_config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
            ),
            model,
        )
        mopt = McoreOptimizerConfig(
            optimizer="adam",
            decoupled_weight_decay=True,  # AdamW
            lr=opt.lr,
            min_lr=opt.lr * opt.min_lr_ratio,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.beta1,
            adam_beta2=opt.beta2,
            adam_eps=opt.eps,
            clip_grad=0.0,  # we clip ourselves after measuring the pre-clip norm (see _optimizer_step)
            bf16=compute == torch.bfloat16,  # fp32 main params and Adam states for 16-bit model params
            fp16=compute == torch.float16,
            params_dtype=compute,
            use_distributed_optimizer=dist_opt,
        )
        # config_overrides={}: weight decay on every parameter, like torch AdamW on the other backends
        # (megatron's default exempts biases and norms).
        self.optimizer = get_megatron_optimizer(mopt, [ddp], config_overrides={})
        # Our LambdaLR drives a one-parameter holder; its lr is copied into megatron's groups before
        # each step, so the schedule (and its checkpointed state) is the base's, shared with FSDP.
        self._lr_holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=opt.lr)
        total = ft_spec.total_train_steps if ft_spec is not None else 1
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self._lr_holder, lr_lambda(opt, total))
        self._apply_lr()
        return ddp

    def _apply_lr(self) -> None:
        assert self._lr_holder is not None and self.optimizer is not None
        lr = self._lr_holder.param_groups[0]["lr"]
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def module(self) -> torch.nn.Module:
        """The GPTModel of this rank's pipeline stage (under the DDP wrapper when training)."""
        assert self.model is not None
        return getattr(self.model, "module", self.model)

    def _release(self) -> None:
        global _LIVE_ENGINES
        if self._initialized:
            _LIVE_ENGINES -= 1
        self._lr_holder = None
        if self._routers is not None:
            self._routers.release()
            self._routers = None

    # ---------------------------------------------------------------- compute
    def _model_inputs(self, mb: TensorDict) -> dict[str, Any]:
        """GPTModel kwargs for a packed row [1, T]: with TransformerEngine, thd ``packed_seq_params`` (its
        causal attention ignores masks); on the local spec, a block-diagonal causal mask [1, 1, T, T]."""
        from tandemrl.engines.megatron.forward import packed_causal_mask, packed_seq_params
        from tandemrl.engines.megatron.model import have_transformer_engine

        ids = mb["input_ids"].reshape(1, -1)
        kw: dict[str, Any] = {"input_ids": ids, "position_ids": mb["position_ids"].reshape(1, -1)}
        if have_transformer_engine():
            kw.update(
                attention_mask=None, packed_seq_params=packed_seq_params(mb["cu_seqlens"], ids.shape[1], ids.device)
            )
        else:
            kw["attention_mask"] = packed_causal_mask(mb["cu_seqlens"], ids.shape[1], ids.device)
        return kw

    def _full_logits(self, output: torch.Tensor) -> torch.Tensor:
        """[T, V] logits from the last stage's vocab-parallel [1, T, V/tp] output ([T, 1] values for a critic:
        its head is laid out as a vocab of one, padded to TP)."""
        from tandemrl.engines.megatron.forward import gather_vocab_logits
        from tandemrl.engines.megatron.value_head import NUM_LABELS

        n = NUM_LABELS if self.config.is_critic else self.model_config.vocab_size
        return gather_vocab_logits(output, n)[0]

    def _forward_logits(self, mb: TensorDict) -> torch.Tensor:
        if self._routers is None:
            return self._full_logits(self.model(**self._model_inputs(mb)))
        routed = mb.get(ROUTED_EXPERTS)
        if routed is None and torch.is_grad_enabled():
            raise ValueError(
                f"megatron.router_replay: the training batch has no '{ROUTED_EXPERTS}' (record them at the "
                "behaviour weights with forward() first; PPOActor does)"
            )
        with self._routers.micro_batch(routed, self._recorded):
            output = self.model(**self._model_inputs(mb))
        return self._full_logits(output)

    @property
    def router_replay(self) -> bool:
        """True when training forwards replay the batch's ``routed_experts`` (``megatron.router_replay``)."""
        return self.config.megatron.router_replay

    @torch.no_grad()
    def forward(
        self,
        batch: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: PostHook | None = None,
        aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The base's forward; with router replay on, a batch without ``routed_experts`` is routed freely
        and the routing of this forward (these weights: the behaviour version when it runs before the
        update) is stored in ``batch["routed_experts"]`` ([B, L, n_layers, k], -1 at dense layers and
        padding); a batch with them replays them."""
        if self._routers is None or ROUTED_EXPERTS in batch:
            return super().forward(batch, output_seqlens, post_hook, aggregate_fn)
        from tandemrl.engines.packing import unpack_to_padded

        self._recorded = []
        try:
            out = super().forward(batch, output_seqlens, post_hook, aggregate_fn)
            recorded = self._recorded
        finally:
            self._recorded = None
        mask = batch["attention_mask"]
        routed = unpack_to_padded(recorded, self._split(batch), mask, pad_value=-1)  # the same split again
        batch[ROUTED_EXPERTS] = routed.to(mask.device)
        return out

    def _run_schedule(
        self,
        mbs: MicroBatches,
        on_logits: Callable[[int, torch.Tensor, TensorDict], torch.Tensor | None],
        forward_only: bool,
        on_forward: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """Megatron's pipeline schedule over the micro-batches; ``on_logits(i, logits, mb)`` runs on the last
        stage and returns the (already weighted) loss to backpropagate, or None when forward-only.
        ``on_forward(i, output)`` runs on every stage right after micro-batch ``i``'s forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device_mbs = [self._to_device(mb) for mb in mbs.mbs]
        n = len(device_mbs)
        order = iter(range(n))

        def forward_step(data_iterator: Iterator[int], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
            i = next(data_iterator)
            output = model(**self._model_inputs(device_mbs[i]))
            if on_forward is not None:
                on_forward(i, output)

            def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
                loss = on_logits(i, self._full_logits(out), device_mbs[i])
                if loss is None:
                    return out.sum() * 0.0, {}
                # The schedule divides the returned loss by n in place: pre-multiply to keep our weights.
                return loss * n, {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=order,
            model=[self.model],
            num_microbatches=n,
            seq_length=max(int(mb["input_ids"].numel()) for mb in device_mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _from_last_stage(self, obj: Any) -> Any:
        """The last pipeline stage's ``obj`` on every stage of this replica."""
        from megatron.core import parallel_state as ps

        box = [obj]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        return box[0]

    def _train_micro_batches(self, mbs: MicroBatches, weights: list[float], scale: float, loss_fn: LossFn) -> float:
        """The base's weighting, extended to MoE load-balancing losses.

        Megatron's routers backpropagate their aux loss with a process-global gradient scale: without a
        pipeline schedule nothing sets it (1: the aux term grew with the number of micro-batches), inside
        one it is ``1/num_microbatches`` (each micro-batch the same share, whatever its tokens). Both
        disagree with the main loss, weighted ``weights[i] * scale`` (its share of the global loss weight,
        times the DP size that DDP's averaging divides out). Each micro-batch's aux loss gets that same
        weight, set just before its backward: the objective is then the same weighted mean of
        per-micro-batch terms with or without PP. The aux loss is nonlinear in its micro-batch's routing
        statistics, so a different split still changes its value (not its weighting).
        """
        from tandemrl.engines.megatron.model import aux_loss_enabled, pop_aux_loss, set_aux_loss_weight

        aux = aux_loss_enabled(self.tf_config)
        aux_sum = 0.0
        if aux:
            pop_aux_loss(self.tf_config)  # drop what earlier forwards recorded
        if self._pp == 1:
            order = iter(weights)

            def loss_then_aux_weight(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
                # Runs after micro-batch i's forward, right before its backward: set its aux weight.
                nonlocal aux_sum
                loss, w = loss_fn(logits, mb), next(order)
                aux_sum += pop_aux_loss(self.tf_config) * w
                set_aux_loss_weight(w * scale)
                return loss

            loss_sum = super()._train_micro_batches(mbs, weights, scale, loss_then_aux_weight if aux else loss_fn)
        else:
            sums = [0.0, 0.0]  # main loss (last stage), aux loss (this stage's layers)

            def on_forward(i: int, output: torch.Tensor) -> None:
                if not aux or not output.requires_grad:
                    return
                sums[1] += pop_aux_loss(self.tf_config) * weights[i]
                # With PP, backwards interleave with later forwards (which also reset the scale): set the
                # weight when micro-batch i's backward reaches this stage's output, before its routers.
                w = weights[i] * scale
                output.register_hook(lambda grad: set_aux_loss_weight(w))

            def on_logits(i: int, logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
                with _filler_guard(mbs.groups[i]):
                    loss = loss_fn(logits, mb)
                sums[0] += float(loss.detach()) * weights[i]
                return loss * (weights[i] * scale)

            self._run_schedule(mbs, on_logits, forward_only=False, on_forward=on_forward)
            loss_sum = float(self._from_last_stage(sums[0]))
            aux_sum = sums[1]
        if aux:  # logged as moe/aux_loss: what the term adds to the objective (comparable to `loss`)
            from megatron.core import parallel_state as ps

            from tandemrl.utils import stats_tracker

            t = torch.tensor(aux_sum, dtype=torch.float64, device=self._reduce_device())
            dist.all_reduce(t, group=ps.get_model_parallel_group())  # PP stages' layers, SP ranks' token shares
            total = self.data_parallel_world_size / scale
            stats_tracker.scalar(**{"moe/aux_loss": self._all_reduce_sum(float(t)) / total})
        return loss_sum

    def _forward_micro_batches(
        self, mbs: MicroBatches, fn: Callable[[torch.Tensor, TensorDict], torch.Tensor]
    ) -> list[torch.Tensor]:
        if self._pp == 1:
            return super()._forward_micro_batches(mbs, fn)
        outs: list[torch.Tensor | None] = [None] * len(mbs.mbs)

        def on_logits(i: int, logits: torch.Tensor, mb: TensorDict) -> None:
            with _filler_guard(mbs.groups[i]):
                outs[i] = fn(logits, mb).detach().cpu()
            return None

        self._run_schedule(mbs, on_logits, forward_only=True)
        return [t.to(self.device) for t in self._from_last_stage(outs)]

    def export_stats(self) -> dict[str, float]:
        """With PP, loss functions (and the stats they record) run on the last stage only: every stage
        reports the last stage's DP-reduced stats."""
        stats = super().export_stats()
        return self._from_last_stage(stats) if self._pp > 1 else stats

    def _optimizer_step(self) -> tuple[float, bool]:
        """Reduce grads over DP (and tied embeddings over PP), measure the pre-clip norm, clip, step."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        assert self.optimizer is not None and self.config.optimizer is not None and self._lr_holder is not None
        finalize_model_grads([self.model])
        self._apply_lr()
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        stepped = math.isfinite(norm)
        if stepped:
            clip = self.config.optimizer.gradient_clipping
            if clip > 0:
                for opt in self.optimizer.chained_optimizers:
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, clip, norm)
            self.optimizer.step_with_ready_grads()
            self._lr_holder.step()  # no-op (no grad); tells LambdaLR an optimizer step happened
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return norm, stepped

    # ---------------------------------------------------------- weight export
    def hf_param_specs(self) -> list[ParamSpec]:
        from tandemrl.engines.megatron.hf_convert import hf_param_specs

        return hf_param_specs(self.model_config, resolve_precision(self.config).compute, critic=self.config.is_critic)

    def iter_hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        from tandemrl.engines.megatron.hf_convert import iter_hf_weights

        yield from iter_hf_weights(self.module, self.model_config, critic=self.config.is_critic)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full HF-named CPU weights on rank 0 (tied lm_head included; a critic's score.* instead),
        empty elsewhere."""
        keep = dist.get_rank() == 0
        sd = {name: t.detach().cpu().clone() for name, t in self.iter_hf_params() if keep}  # all ranks iterate
        if not keep:
            return {}
        tied = getattr(self.model_config, "tie_word_embeddings", False)
        if "lm_head.weight" not in sd and tied and not self.config.is_critic:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd

    # ----------------------------------------------------------- checkpoints
    def _load_hf(self, meta: SaveLoadMeta) -> None:
        from tandemrl.engines.megatron.hf_convert import load_hf_weights

        load_hf_weights(self.module, meta.path, self.model_config, critic=self.config.is_critic, seed=self.config.seed)
        if self.optimizer is not None:  # fp32 main copies of 16-bit weights follow the new weights
            self.optimizer.reload_model_params()

    def _save_checkpoint(self, meta: SaveLoadMeta) -> bool:
        """A megatron-core dist checkpoint (layout-free: resumes on another DP/TP/PP split)."""
        from tandemrl.engines.megatron.checkpoint import save_checkpoint

        with_optim = self.optimizer is not None and meta.with_optim
        save_checkpoint(meta.path, self.module, self.optimizer, with_optim)
        return with_optim

    def _load_checkpoint(self, meta: SaveLoadMeta, with_optim: bool) -> None:
        from tandemrl.engines.megatron.checkpoint import load_checkpoint

        load_checkpoint(meta.path, self.module, self.optimizer, with_optim)

    def _load_recoverable(self, meta: SaveLoadMeta) -> None:
        super()._load_recoverable(meta)
        if self.optimizer is not None:  # megatron's param groups follow the restored schedule
            self._apply_lr()
