"""What a rollout workflow is, and the slice of an inference client it may use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tandemrl.api.renamed import retired_names

if TYPE_CHECKING:
    from tandemrl.api.inference import ModelRequest, ModelResponse
    from tandemrl.api.types import TensorDict


@runtime_checkable
class GenerationClient(Protocol):
    """Anything that continues one prompt and knows its weight version.

    The real one is the remote vLLM/SGLang client; tests use small in-process stand-ins.
    """

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    def get_version(self) -> int: ...


class RolloutWorkflow(ABC):
    """Turns one dataset row into training data by talking to an inference client.

    ``arun_episode`` runs on the executor's event loop: it must not block (run CPU-heavy
    work such as reward functions in a thread, see ``tandemrl.rewards.runner``).
    """

    @abstractmethod
    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        """A padded batch [n, L] (with ``attention_mask``) for this row, or None to reject it."""


if not TYPE_CHECKING:  # old names fail with the line naming the new one (tandemrl.api.renamed)
    __getattr__ = retired_names(__name__)
