"""Config keys that moved or went away, so an old YAML file or override fails with the new key.

``retired_key(parent, prefix, name, rest)`` is asked by the loader for each key it walks:
``parent`` is the dataclass holding ``name`` at dotted ``prefix``; ``rest`` is what follows the
key in an override (``.lr`` in ``actor.optimizer.lr=...``). It returns the one-line reason, or None. Each line says when the notice goes (``REMOVED_IN``,
``tandemrl.api.renamed``, with the retired Python names); after that an old key is an unknown one.
"""

from __future__ import annotations

import dataclasses
import functools

from tandemrl.api.renamed import REMOVED_IN
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.configs.rollout import InferenceClientConfig

# (schema, field) -> why a field the schema had may no longer be set.
_REMOVED: dict[tuple[type, str], str] = {
    (TrainEngineConfig, "backend"): "was removed (it was never read; DeepSpeed and Megatron options are under "
    "deepspeed.* and megatron.*)",
    (InferenceClientConfig, "consumer_batch_size"): "was removed: the trainer derives it (train_dataset.batch_size "
    "per data-parallel rank)",
}


@functools.cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _holds_engine(cls: type) -> bool:
    return any(
        f.name == "engine" and f.type in (TrainEngineConfig, "TrainEngineConfig") for f in dataclasses.fields(cls)
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def retired_key(parent: type, prefix: str, name: str, rest: str = "") -> str | None:
    """Why ``prefix.name`` cannot be set (it moved or was removed), or None if it is fine."""
    why = _retired(parent, prefix, name, rest)
    return None if why is None else f"{why}; this notice goes in tandemrl {REMOVED_IN}"


def _retired(parent: type, prefix: str, name: str, rest: str) -> str | None:
    old = _join(prefix, name) + rest
    reason = _REMOVED.get((parent, name))
    if reason is not None:
        return f"Config key '{old}' {reason}"
    if name in _names(parent):
        return None
    if _holds_engine(parent) and name in _names(TrainEngineConfig):
        return f"Config key '{old}' moved to '{_join(prefix, 'engine.' + name)}{rest}'"
    if parent is TrainEngineConfig and prefix == "ref" and name in _names(PPOActorConfig):
        return (
            f"Config key '{old}' was removed: 'ref' is only the reference model (a TrainEngineConfig); "
            f"the algorithm reads 'actor.{name}{rest}'"
        )
    return None
