"""Client side of the inference servers: per-server request builders, the HTTP client, weight receive.

Importing this package is cheap (no vllm, sglang or HTTP libraries). The protocol and its
value types live in ``tandemrl.api``.
"""

from tandemrl.inference.backend import BadServerPayload
from tandemrl.inference.registry import get_backend

__all__ = ["BadServerPayload", "get_backend"]
