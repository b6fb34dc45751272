"""The config of a ``tandemrl tinker-serve`` job started by a launcher (docs/tinker.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.utils import ClusterConfig, RunNameConfig

if TYPE_CHECKING:
    from tandemrl.api.allocation import AllocationMode


@dataclass
class TinkerModelConfig:
    """The base model; the launcher starts the inference servers on the same ``path``."""

    path: str = field(
        default="",
        metadata={"help": "HF model directory, hub id, `tiny:qwen2` or `smollm2-135m` (as every model path)."},
    )


@dataclass
class TinkerSection:
    """What ``tandemrl tinker-serve`` takes on its command line."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address the Tinker API binds."})
    port: int = field(default=0, metadata={"help": "Port of the Tinker API (0: a free one).", "min": 0})
    model_name: str = field(default="", metadata={"help": "Name clients pass as base_model (empty: model.path)."})
    full_weight: bool = field(
        default=False,
        metadata={
            "help": "Train every weight for one client at a time on allocation_mode's training backend "
            "(fsdp, deepspeed or megatron; data parallel) instead of LoRA adapters (which train on fsdp)."
        },
    )
    compute_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the training forward and backward; weights, AdamW state and logprobs stay fp32.",
            "choices": ["float32", "bfloat16"],
        },
    )
    max_lora_rank: int = field(default=8, metadata={"help": "Largest adapter rank a client may ask for.", "min": 1})
    max_adapters: int = field(default=4, metadata={"help": "Most live LoRA training clients.", "min": 1})
    out: str = field(default="", metadata={"help": "Checkpoint directory (empty: the run directory's ckpt/)."})
    api_key: str = field(default="", metadata={"help": "Key clients must send (empty: a fresh tml- key)."})
    key_file: str = field(default="", metadata={"help": "Also write the key here (mode 0600)."})


@dataclass
class TinkerServeConfig(RunNameConfig):
    """A Tinker API job: ``allocation_mode`` names one inference server (LoRA-enabled through
    ``launcher.server_args`` unless ``tinker.full_weight``) and a data-parallel training component (``fsdp:d2``: two
    torchrun ranks train every client's batches, rank 0 serves the API)."""

    allocation_mode: str = field(
        default="vllm:d1+fsdp:d1",
        metadata={"help": "One inference server and the training ranks (data parallel only, e.g. fsdp:d2)."},
    )
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: TinkerModelConfig = field(default_factory=TinkerModelConfig)
    tinker: TinkerSection = field(default_factory=TinkerSection)

    @property
    def allocation(self) -> AllocationMode:
        """``allocation_mode`` parsed (``configs.backends.parse_allocation``), on each read."""
        return parse_allocation(self.allocation_mode)
