"""The floor every layer stands on: contracts and value types, importing nothing else of tandemrl.

- ``engine``: ``TrainEngine`` (what an algorithm sees), ``TrainBackend`` (what a training backend implements)
  and the loss/hook signatures.
- ``backend``: ``InferenceBackend``, the request builder/parser protocol of an inference server.
- ``workflow``: ``RolloutWorkflow`` and the ``GenerationEngine`` slice a workflow may call.
- ``inference``: ``ModelRequest``/``ModelResponse``, ``ParamSpec``, ``WeightUpdateMeta`` and the
  other values that cross the HTTP boundary.
- ``generation``: ``GenerationHyperparameters`` (sampling parameters of one request).
- ``types``: ``TensorDict``, ``RolloutBatch``, ``ParallelStrategy``, ``FinetuneSpec``, ``SaveLoadMeta``.
- ``allocation``: ``AllocationMode``, the parsed ``allocation_mode`` string.
"""

from tandemrl.api.allocation import AllocationMode
from tandemrl.api.backend import InferenceBackend
from tandemrl.api.engine import LossFn, LossWeightFn, PostHook, TrainBackend, TrainEngine
from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.inference import (
    GenerateChunk,
    HttpRequest,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    StopReason,
    VersionSpan,
    WeightUpdateMeta,
)
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, RolloutBatch, SaveLoadMeta, TensorDict
from tandemrl.api.workflow import GenerationEngine, RolloutWorkflow

__all__ = [
    "AllocationMode",
    "FinetuneSpec",
    "GenerateChunk",
    "GenerationEngine",
    "GenerationHyperparameters",
    "HttpRequest",
    "InferenceBackend",
    "LossFn",
    "LossWeightFn",
    "ModelRequest",
    "ModelResponse",
    "ParallelStrategy",
    "ParamSpec",
    "PostHook",
    "RolloutBatch",
    "RolloutWorkflow",
    "SaveLoadMeta",
    "StopReason",
    "TensorDict",
    "TrainBackend",
    "TrainEngine",
    "VersionSpan",
    "WeightUpdateMeta",
]
