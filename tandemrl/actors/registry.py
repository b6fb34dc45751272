"""Which class implements an algorithm on a backend, imported only when asked for.

Adding a backend or an algorithm is one row here plus its thin bound class.
"""

from __future__ import annotations

import importlib

_CLASSES: dict[tuple[str, str], str] = {
    ("lm", "fsdp"): "tandemrl.actors.fsdp:FSDPLMEngine",
    ("ppo_actor", "fsdp"): "tandemrl.actors.fsdp:FSDPPPOActor",
    ("ppo_critic", "fsdp"): "tandemrl.actors.fsdp:FSDPPPOCritic",
    ("reinforce", "fsdp"): "tandemrl.actors.fsdp:FSDPReinforceActor",
    ("lm", "deepspeed"): "tandemrl.actors.deepspeed:DeepSpeedLMEngine",
    ("ppo_actor", "deepspeed"): "tandemrl.actors.deepspeed:DeepSpeedPPOActor",
    ("ppo_critic", "deepspeed"): "tandemrl.actors.deepspeed:DeepSpeedPPOCritic",
    ("reinforce", "deepspeed"): "tandemrl.actors.deepspeed:DeepSpeedReinforceActor",
    ("lm", "megatron"): "tandemrl.actors.megatron:MegatronLMEngine",
    ("ppo_actor", "megatron"): "tandemrl.actors.megatron:MegatronPPOActor",
    ("ppo_critic", "megatron"): "tandemrl.actors.megatron:MegatronPPOCritic",
    ("reinforce", "megatron"): "tandemrl.actors.megatron:MegatronReinforceActor",
}


def register_engine_class(algorithm: str, backend: str, target: str) -> None:
    """Register ``module:Class`` as ``algorithm`` on ``backend``."""
    _CLASSES[(algorithm, backend)] = target


def engine_class(algorithm: str, backend: str) -> type:
    """The bound engine class, e.g. ``engine_class("lm", "fsdp") -> FSDPLMEngine``."""
    try:
        target = _CLASSES[(algorithm, backend)]
    except KeyError:
        have = sorted(b for a, b in _CLASSES if a == algorithm)
        raise ValueError(
            f"allocation_mode: backend '{backend}' has no '{algorithm}' engine (available: {', '.join(have) or 'none'})"
        ) from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
