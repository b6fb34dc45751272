"""What a rollout workflow is, and the slice of an inference engine it may use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tandemrl.api.inference import ModelRequest, ModelResponse
    from tandemrl.api.types import TensorDict


@runtime_checkable
class GenerationEngine(Protocol):
    """Anything that continues one prompt and knows its weight version.

    The real one is the remote vLLM/SGLang client; tests use small in-process stand-ins.
    """

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    def get_version(self) -> int: ...


class RolloutWorkflow(ABC):
    """Turns one dataset row into training data by talking to an inference engine.

    ``arun_episode`` runs on the executor's event loop: it must not block (run CPU-heavy
    work such as reward functions in a thread, see ``tandemrl.rewards.runner``).
    """

    @abstractmethod
    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> TensorDict | None:
        """A padded batch [n, L] (with ``attention_mask``) for this row, or None to reject it."""
