"""The floor every layer stands on: contracts and value types, importing nothing else of tandemrl.

- ``engine``: ``TrainEngine`` (what an algorithm sees), ``TrainBackend`` (what a training backend implements)
  and the loss/hook signatures.
- ``backend``: ``InferenceBackend``, the request builder/parser protocol of an inference server.
- ``workflow``: ``RolloutWorkflow`` and the ``GenerationClient`` slice a workflow may call.
- ``inference``: ``ModelRequest``/``ModelResponse``, ``ParamSpec``, ``WeightUpdateMeta`` and the
  other values that cross the HTTP boundary.
- ``generation``: ``GenerationHyperparameters`` (sampling parameters of one request).
- ``types``: ``TensorDict``, ``RolloutBatch``, ``ParallelStrategy``, ``FinetuneSpec``, ``SaveLoadMeta``.
- ``allocation``: ``AllocationMode``, the parsed ``allocation_mode`` string.
"""

from typing import TYPE_CHECKING

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
from tandemrl.api.renamed import retired_names
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, RolloutBatch, SaveLoadMeta, TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow

__all__ = [
    "AllocationMode",
    "FinetuneSpec",
    "GenerateChunk",
    "GenerationClient",
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

if not TYPE_CHECKING:  # old names fail with the line naming the new one (tandemrl.api.renamed)
    __getattr__ = retired_names(__name__)
