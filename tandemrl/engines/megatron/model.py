"""HF config -> megatron-core TransformerConfig / GPTModel for Qwen2, Qwen3, Llama and Qwen3-MoE / Qwen2-MoE.

One hand-written mapping (no mbridge): the supported architectures differ only in a few flags, and
every flag an HF config may set that we cannot reproduce exactly raises instead of silently diverging.
"""

from __future__ import annotations

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
    # megatron-core refuses to train an MoE layer under TP without sequence parallelism, and the local
    # (non-TE) spec's norms cannot do sequence parallelism: MoE + TP needs TransformerEngine.
    moe_sequence_parallel = is_moe(hf_config) and tp > 1
    if moe_sequence_parallel and not have_transformer_engine():
        raise ValueError(
            f"tp={tp} with an MoE model needs sequence parallelism, which needs TransformerEngine (CUDA); "
            "use ep (expert parallelism) instead of tp for MoE here"
        )
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
        # Off where possible (the local spec's WrappedTorchNorm asserts it is off); with it on (MoE + TP, TE only)
        # the packed sequence length must be a multiple of tp.
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
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


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
        is_pad = (args[0] == pad_token_id).unsqueeze(-1)
        return torch.where(is_pad, out.detach(), out)

    emb.register_forward_hook(hook)
