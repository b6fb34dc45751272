"""Client side of the inference servers: protocol types and per-server request builders.

Importing this package is cheap (no vllm, sglang or HTTP libraries).
"""

from tandemrl.inference.backend import BadServerPayload, InferenceBackend, get_backend
from tandemrl.inference.types import (
    GenerateChunk,
    HttpRequest,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    StopReason,
    VersionSpan,
    WeightUpdateMeta,
)

__all__ = [
    "BadServerPayload",
    "GenerateChunk",
    "HttpRequest",
    "InferenceBackend",
    "ModelRequest",
    "ModelResponse",
    "ParamSpec",
    "StopReason",
    "VersionSpan",
    "WeightUpdateMeta",
    "get_backend",
]
