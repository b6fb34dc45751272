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

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tandemrl.api.renamed import retired_names

if TYPE_CHECKING:
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
    from tandemrl.api.parallel import ParallelStrategy
    from tandemrl.api.types import FinetuneSpec, RolloutBatch, SaveLoadMeta, TensorDict
    from tandemrl.api.workflow import GenerationClient, RolloutWorkflow

# Each name's module, imported on first use: ``import tandemrl.api.X`` (and so ``tandemrl.configs``) needs
# no torch unless X does.
_HOME = {
    "AllocationMode": "allocation",
    "InferenceBackend": "backend",
    **dict.fromkeys(("LossFn", "LossWeightFn", "PostHook", "TrainBackend", "TrainEngine"), "engine"),
    "GenerationHyperparameters": "generation",
    **dict.fromkeys(
        (
            "GenerateChunk",
            "HttpRequest",
            "ModelRequest",
            "ModelResponse",
            "ParamSpec",
            "StopReason",
            "VersionSpan",
            "WeightUpdateMeta",
        ),
        "inference",
    ),
    "ParallelStrategy": "parallel",
    **dict.fromkeys(("FinetuneSpec", "RolloutBatch", "SaveLoadMeta", "TensorDict"), "types"),
    **dict.fromkeys(("GenerationClient", "RolloutWorkflow"), "workflow"),
}

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

_retired = retired_names(__name__)  # old names fail with the line naming the new one (tandemrl.api.renamed)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    return _retired(name)
