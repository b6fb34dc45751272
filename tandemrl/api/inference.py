"""Value types of the inference protocol: requests, responses, weight-update metadata.

Pure data: no HTTP, no torch, no server imports, so every layer (workflows, the HTTP
client, trainers) can share them cheaply.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tandemrl.api.generation import GenerationHyperparameters

StopReason = Literal["stop", "length", "abort", "tool_calls"]
HttpMethod = Literal["GET", "POST"]
# What a pause for a weight update does with in-flight requests: "abort" returns their partial
# output (the client resubmits it); "keep" holds them in the server, which continues them after it.
PauseMode = Literal["abort", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "keep")


@dataclass
class ModelRequest:
    """One prompt to continue; ``rid`` lets the client keep a prompt's samples on one server."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any | None = None


@dataclass
class ModelResponse:
    """A finished generation, possibly stitched from several interrupted server calls."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Weight version that sampled each output token (same length as output_tokens).
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")  # time to first token

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of one chunk were sampled by weights ``version``.

    ``version`` is None when the server's label is not an integer (e.g. vLLM's initial
    "default"), meaning "the version the client had when it sent the request".
    """

    version: int | None
    start: int
    end: int


@dataclass
class GenerateChunk:
    """The parsed result of ONE generate HTTP call (a whole or partial continuation)."""

    output_tokens: list[int]
    output_logprobs: list[float]
    stop_reason: StopReason
    # Per-token weight versions as the server reported them; None if it reports none.
    version_spans: list[VersionSpan] | None = None

    def token_versions(self, fallback: int) -> list[int]:
        """One version per output token; tokens no span labels get ``fallback``."""
        out = [fallback] * len(self.output_tokens)
        for span in self.version_spans or []:
            if span.version is None:
                continue
            for i in range(max(span.start, 0), min(span.end, len(out))):
                out[i] = span.version
        return out


@dataclass(frozen=True)
class HttpRequest:
    """One HTTP call for the shared client to send: ``json`` is the body (None for no body)."""

    method: HttpMethod
    path: str
    json: dict[str, Any] | None = None
    timeout: float | None = None  # seconds; None means the client's default


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype (torch name without "torch.", e.g. "bfloat16") of a broadcast tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class WeightUpdateMeta:
    """How the trainer hands new weights to the inference servers.

    "disk": the trainer writes an HF safetensors directory at ``path`` and each server
    reloads it. "collective": the trainer head (rank 0) broadcasts tensors to every
    inference rank over a process group of ``world_size`` ranks rendezvousing at
    ``group_addr:group_port`` (``tandemrl.weights.plan.collective_update`` builds one).

    ``dtype`` (collective only): cast floating-point tensors to this torch dtype (e.g.
    "bfloat16", what a bf16 server casts to on load anyway) before sending; None sends the
    engine's export dtype.

    ``delta`` (collective only): "none" broadcasts every bucket whole; "xor" / "sparse" send
    each bucket as its change against the previous update (``tandemrl.weights.delta``),
    with a whole "anchor" update first and then every ``anchor_every`` updates. ``delta_tag``
    and ``delta_base`` are set per update by the trainer (this update's id and the id the
    delta applies to; ``delta_base`` None means an anchor).
    """

    type: Literal["disk", "collective"]
    path: str | None = None
    bucket_size_mb: int = 512
    group_addr: str = "127.0.0.1"
    group_port: int = 0
    group_name: str = "tandemrl_weight_update"
    world_size: int = 0
    comm_backend: str = "nccl"  # process-group backend of the collective ("nccl" or "gloo")
    version: int | None = None
    dtype: str | None = None
    delta: Literal["none", "xor", "sparse"] = "none"
    anchor_every: int = 10
    delta_tag: str | None = None
    delta_base: str | None = None

    def __post_init__(self) -> None:
        if self.type not in ("disk", "collective"):
            raise ValueError(f"WeightUpdateMeta.type must be 'disk' or 'collective', got {self.type!r}")
        if self.bucket_size_mb <= 0:
            raise ValueError(f"WeightUpdateMeta.bucket_size_mb must be positive, got {self.bucket_size_mb}")
        if self.delta not in ("none", "xor", "sparse"):
            raise ValueError(f"WeightUpdateMeta.delta must be 'none', 'xor' or 'sparse', got {self.delta!r}")
        if self.delta != "none" and self.type != "collective":
            raise ValueError(f"WeightUpdateMeta.delta={self.delta!r} needs a 'collective' update, not {self.type!r}")
        if self.dtype is not None and (self.dtype not in ("bfloat16", "float16", "float32") or self.type == "disk"):
            raise ValueError(
                f"WeightUpdateMeta.dtype must be None or bfloat16/float16/float32 on a collective update, "
                f"got {self.dtype!r} ({self.type})"
            )
        if self.anchor_every < 1:
            raise ValueError(f"WeightUpdateMeta.anchor_every must be >= 1, got {self.anchor_every}")
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta.path is required for a 'disk' update")
        if self.type == "collective":
            if self.world_size < 2:
                raise ValueError(
                    f"WeightUpdateMeta.world_size must be >= 2 (trainer head + inference ranks), got {self.world_size}"
                )
            if not 0 < self.group_port < 65536:
                raise ValueError(f"WeightUpdateMeta.group_port must be in 1..65535, got {self.group_port}")

    def with_version(self, version: int) -> WeightUpdateMeta:
        """A copy tagged with the version the update installs."""
        return replace(self, version=version)

    @classmethod
    def from_disk(
        cls,
        path_root: str,
        experiment_name: str | None = None,
        trial_name: str | None = None,
        bucket_size_mb: int = 512,
    ) -> WeightUpdateMeta:
        """Disk update under ``path_root[/experiment[/trial]]/weight_update``."""
        parts = [p for p in (experiment_name, trial_name) if p]
        path = os.path.join(path_root, *parts, "weight_update")
        return cls(type="disk", path=path, bucket_size_mb=bucket_size_mb)


def serves_adapter(serve: str, on_gpu: bool) -> bool:
    """``LoRAConfig.serve`` decided: True to send the adapter to the inference servers, False for merged weights.

    ``auto`` is the adapter on GPUs and merged weights on CPU, where vLLM's LoRA path generated at 0.46x the merged
    weights' tokens/s (bench/lora_serving.py). Shared by the weight push, the launchers and tinker-serve.
    """
    if serve not in ("auto", "adapter", "merged"):
        raise ValueError(f"lora.serve: unknown value {serve!r} (auto, adapter or merged)")
    return serve == "adapter" or (serve == "auto" and on_gpu)
