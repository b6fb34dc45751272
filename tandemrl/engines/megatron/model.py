"""HF config -> megatron-core TransformerConfig / GPTModel for Qwen2, Qwen3, Llama and Qwen3-MoE / Qwen2-MoE.

One hand-written mapping (no mbridge): the supported architectures differ only in a few flags, and
every flag an HF config may set that we cannot reproduce exactly raises instead of silently diverging.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

DENSE_TYPES = ("qwen2", "qwen3", "llama", "mistral")
MOE_TYPES = ("qwen3_moe", "qwen2_moe")


def have_transformer_engine() -> bool:
    """TE specs need CUDA and an importable transformer_engine; otherwise the local (pure torch) spec."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def tag_param(param: torch.Tensor, name: str, value: bool) -> None:
    """Set a per-parameter flag megatron-core reads (``sequence_parallel``, ``allreduce``)."""
    setattr(param, name, value)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocab-parallel embedding needs rows divisible by TP; extra rows are zero and sliced off."""
    if vocab_size <= 0 or tp <= 0:
        raise ValueError(f"vocab_size={vocab_size} and tp={tp} must be positive")
    return (vocab_size + tp - 1) // tp * tp


def rope_theta(hf_config: Any) -> float:
    """rope theta from transformers 5 (rope_parameters) or 4 (rope_theta); only plain RoPE is supported."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"hf config rope_type={rope_type!r} is not supported by the Megatron backend (only 'default')")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("hf config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def is_moe(hf_config: Any) -> bool:
    return hf_config.model_type in MOE_TYPES


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """1 for layers with a sparse MoE block, 0 for dense MLP layers (HF's decoder_sparse_step / mlp_only_layers)."""
    n = hf_config.num_hidden_layers
    if not is_moe(hf_config):
        return [0] * n
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [int(i not in only and (i + 1) % step == 0) for i in range(n)]


def shared_expert_size(hf_config: Any) -> int:
    """Qwen2-MoE's gated shared expert width (0: none, e.g. Qwen3-MoE)."""
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if is_moe(hf_config) else 0


def _check_supported(hf_config: Any) -> None:
    mt = hf_config.model_type
    if mt not in DENSE_TYPES + MOE_TYPES:
        raise ValueError(f"hf config model_type={mt!r} is not supported; choose one of {DENSE_TYPES + MOE_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hf config hidden_act={hf_config.hidden_act!r} is not supported (only 'silu' SwiGLU)")
    if getattr(hf_config, "use_sliding_window", False) or (mt == "mistral" and hf_config.sliding_window):
        raise ValueError("hf config use_sliding_window/sliding_window is not supported by the Megatron backend")
    if mt != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"hf config attention_bias=True ({mt}: o_proj bias) is not supported by the Megatron backend")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("hf config mlp_bias=True is not supported by the Megatron backend")
    if mt == "qwen2_moe" and getattr(hf_config, "qkv_bias", True) is False:
        raise ValueError("hf config qkv_bias=False is not supported for qwen2_moe")
    if is_moe(hf_config) and hf_config.num_experts_per_tok == 1 and getattr(hf_config, "norm_topk_prob", False):
        raise ValueError(
            "hf config num_experts_per_tok=1 with norm_topk_prob=True is not supported (Megatron needs "
            "pre-softmax routing for top-1)"
        )
    rope_theta(hf_config)


def transformer_config_from_hf(
    hf_config: Any, *, tp: int, pp: int, ep: int, params_dtype: torch.dtype
) -> TransformerConfig:
    """The TransformerConfig whose GPTModel computes exactly what the HF model computes (fp32: ~1e-6)."""
    _check_supported(hf_config)
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers={hf_config.num_hidden_layers} must be divisible by pp={pp}")
    if not is_moe(hf_config) and ep != 1:
        raise ValueError(f"ep={ep} needs an MoE model, but hf config model_type={hf_config.model_type!r} is dense")
    # megatron-core refuses to train an MoE layer under TP without sequence parallelism. The local (non-TE)
    # spec's norms refuse it too; build_gpt_model swaps in SequenceParallelRMSNorm and pads the sequence.
    moe_sequence_parallel = is_moe(hf_config) and tp > 1
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from tandemrl.engines.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type in ("qwen2", "qwen2_moe"),
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions need CUDA kernels (apex/TE); exactness vs HF matters more than their speed-up here.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # Off where possible (dense TP needs none of it); on for MoE + TP, see build_gpt_model.
        sequence_parallel=moe_sequence_parallel,
        variable_seq_lengths=True,  # packed micro-batches differ in length (PP p2p shapes)
        moe_token_dispatcher_type="alltoall",  # the default (allgather) rejects variable_seq_lengths, even dense
    )
    if is_moe(hf_config):
        pattern = moe_layer_pattern(hf_config)
        kw.update(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_layer_freq=pattern,
            moe_grouped_gemm=False,
            moe_router_score_function="softmax",
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. Top-k on logits then
            # softmax over the k (pre_softmax=False) is the renormalised form; pre_softmax=True the plain one.
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss" if getattr(hf_config, "output_router_logits", False) else "none",
            moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
            moe_permute_fusion=False,
        )
        if kw["moe_router_load_balancing_type"] == "none":
            kw["moe_aux_loss_coeff"] = 0.0
        if shared_expert_size(hf_config):
            kw.update(moe_shared_expert_intermediate_size=shared_expert_size(hf_config), moe_shared_expert_gate=True)
    return TransformerConfig(**kw)


def build_gpt_model(hf_config: Any, tf_config: TransformerConfig) -> GPTModel:
    """This rank's PP stage of the GPTModel (parallel_state must be initialised); weights are random until loaded."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tandemrl.engines.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    spec = get_gpt_decoder_block_spec(
        tf_config, use_transformer_engine=have_transformer_engine(), normalization="RMSNorm"
    )
    if tf_config.sequence_parallel and not have_transformer_engine():
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = _swap_module(copy.deepcopy(spec), WrappedTorchNorm, SequenceParallelRMSNorm)
    model = GPTModel(
        tf_config,
        spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tf_config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        parallel_output=True,
    )
    _emulate_padding_idx(model, getattr(hf_config, "pad_token_id", None))
    _mark_expert_tp_params(model, tf_config)
    if tf_config.sequence_parallel:
        _pad_sequence_to_tp_multiple(
            model, tf_config.tensor_model_parallel_size, getattr(hf_config, "pad_token_id", None)
        )
    if tf_config.params_dtype != torch.float32:
        # Every parameter in the model dtype, as HF loads it and as megatron's Float16Module makes it on GPU:
        # the local spec builds its torch norms in fp32, and mcore's optimizers (and their checkpoints)
        # mishandle a param group that mixes 16-bit and fp32 parameters.
        model.to(tf_config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (what the local spec's WrappedTorchNorm builds) for a sequence-parallel model.

    Under sequence parallelism each TP rank normalises its own slice of the tokens, so each holds part of
    the weight's gradient: ``sequence_parallel=True`` on the weight makes ``finalize_model_grads`` sum it
    over TP (as TE's norms mark theirs). Same constructor keywords as megatron's norm classes.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm: only plain RMSNorm (no zero-centered gamma) is supported")
        super().__init__(hidden_size, eps=eps)
        tag_param(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def _swap_module(spec: Any, old: type, new: type) -> Any:
    """``spec`` (a ModuleSpec / submodules dataclass tree) with every ``old`` module class replaced by ``new``."""
    if spec is old:
        return new
    if isinstance(spec, list):
        return [_swap_module(s, old, new) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _swap_module(getattr(spec, f.name), old, new))
    return spec


def _pad_sequence_to_tp_multiple(model: torch.nn.Module, tp: int, pad_token_id: int | None) -> None:
    """Sequence parallelism splits the packed row over TP ranks: pad it to a multiple of ``tp`` inside the model.

    The padding is its own causal block (attends only to itself, as trailing padding does in forward.py), so
    real tokens see exactly what they see unpadded (MoE routes per token, without capacity); the last stage
    slices the logits back to the real length. Pads use ``pad_token_id``, whose embedding gets no gradient.
    Load-balancing statistics (aux loss) do count the few pad tokens.
    """
    real_len: list[int] = []

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        names = ("input_ids", "position_ids", "attention_mask")
        if len(args) > len(names):
            raise TypeError(f"sequence-parallel GPTModel: pass arguments after {names} by keyword")
        kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
        ids = kwargs["input_ids"]
        n = ids.shape[1]
        real_len.append(n)
        extra = -n % tp
        if extra:
            fill = pad_token_id if pad_token_id is not None else 0
            kwargs["input_ids"] = torch.cat([ids, ids.new_full((ids.shape[0], extra), fill)], 1)
            pos = kwargs["position_ids"]
            kwargs["position_ids"] = torch.cat(
                [pos, torch.arange(extra, device=pos.device).expand(pos.shape[0], -1)], 1
            )
            mask = kwargs.get("attention_mask")
            if mask is not None:  # [b, 1, n, n], True = masked: padding is one more causal block
                full = mask.new_ones(*mask.shape[:-2], n + extra, n + extra)
                full[..., :n, :n] = mask
                full[..., n:, n:] = ~torch.ones(extra, extra, dtype=torch.bool, device=mask.device).tril()
                kwargs["attention_mask"] = full
            psp = kwargs.get("packed_seq_params")
            if psp is not None:
                from tandemrl.engines.megatron.forward import packed_seq_params

                kwargs["packed_seq_params"] = packed_seq_params(psp.cu_seqlens_q, n + extra, ids.device)
        return (), kwargs

    def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        n = real_len.pop()
        if getattr(module, "post_process", False) and isinstance(output, torch.Tensor):
            return output[:, :n]  # logits [b, s, v]; earlier stages hand on padded hidden states
        return output

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)


def _mark_expert_tp_params(model: torch.nn.Module, tf_config: TransformerConfig) -> None:
    """With an expert TP other than the attention TP, reduce expert weights over the expert groups.

    megatron-core marks expert weights ``allreduce=False`` (gradients reduced over the expert-DP group, own
    optimizer whose grad norm sums over the expert TP x PP group) only when EP > 1. With EP = 1 they count as
    dense params of the attention layout, wrong whenever ETP != TP: under ``(attn:d2|ffn:t2)`` DDP averages
    the *different* expert shards of the two DP ranks (and the norm misses one shard); under ``t2`` (ETP 1,
    sequence parallel) the TP ranks' expert replicas saw different tokens and are never summed. Marked as
    under EP, both follow the expert groups; with ETP == TP (or EP > 1) nothing changes.
    """
    etp = tf_config.expert_tensor_parallel_size or tf_config.tensor_model_parallel_size
    if tf_config.expert_model_parallel_size > 1 or etp == tf_config.tensor_model_parallel_size:
        return
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                tag_param(param, "allreduce", False)


def _emulate_padding_idx(model: torch.nn.Module, pad_token_id: int | None) -> None:
    """HF's ``nn.Embedding(padding_idx=pad_token_id)``: lookups of the pad token give its row no gradient.

    Megatron's embedding has no padding_idx. Without this, a pad token inside a sequence trains
    its (usually zero) row, whose RMSNorm gradient is ~1/sqrt(eps): updates diverge from HF's.
    Only the lookup's gradient is cut, so a tied output layer still trains that row, as in HF.
    """
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if emb is None or pad_token_id is None:
        return

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        is_pad = (args[0] == pad_token_id).unsqueeze(-1)  # [b, s, 1]
        if getattr(module, "reduce_scatter_embeddings", False):  # sequence parallel: out is [s / tp, b, h]
            from megatron.core import parallel_state as ps

            is_pad = is_pad.transpose(0, 1).chunk(ps.get_tensor_model_parallel_world_size())[
                ps.get_tensor_model_parallel_rank()
            ]
        return torch.where(is_pad, out.detach(), out)

    emb.register_forward_hook(hook)


# ----------------------------------------------------------------------------- MoE load-balancing loss


def aux_loss_enabled(tf_config: Any) -> bool:
    """Whether the routers add megatron's load-balancing ("aux_loss") term to the objective."""
    return bool(
        getattr(tf_config, "num_moe_experts", None)
        and tf_config.moe_router_load_balancing_type == "aux_loss"
        and tf_config.moe_aux_loss_coeff
    )


def set_aux_loss_weight(weight: float) -> None:
    """Gradient weight of the aux losses of the next backward (megatron's ``MoEAuxLossAutoScaler``).

    The router attaches its aux loss to the activations and, in backward, gives it the gradient
    ``main_loss_backward_scale``: a process-global read when that backward runs. A fresh [1]-shaped tensor
    (megatron's schedules ``copy_`` a [1]-shaped scale into it; a scale first created by a backward is [] and
    would make that copy fail when a pipeline engine follows a non-pipeline one in the same process).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([float(weight)], device=device)


def pop_aux_loss(tf_config: Any) -> float:
    """Sum over this rank's MoE layers of the load-balancing losses (coefficient included) recorded by the
    training forwards since the last call; resets megatron's layer-wise tracker. Under sequence parallelism
    each TP rank holds its share of the sum."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None:
        return 0.0
    value = float(entry["values"].sum()) * tf_config.moe_aux_loss_coeff  # the tracker holds aux_loss / coeff
    entry["values"].zero_()
    return value
