"""Which Ray nodes run what: per-component resource requests, and naming a lost node.

``launcher.ray.server_resources`` and ``launcher.ray.trainer_resources`` (in the config or as
overrides; the training script never sees the ``launcher`` section) are Ray custom resources that
each inference server actor, and each trainer rank's placement-group bundle, requires on top of
its GPUs/CPUs. A node offers them when it is started with ``ray start --resources='{"rollout": 8}'``,
so they say which nodes get which component, e.g. servers on the nodes started with ``rollout``
and ranks on those started with ``train``::

    launcher:
      ray:
        server_resources: {rollout: 1}   # each server actor takes 1 of a node's ``rollout`` units
        trainer_resources: {train: 1}    # each rank's bundle takes 1 of a node's ``train`` units

A node holds as many servers or ranks as it has units, so give a node at least as many units as
the servers or ranks it should hold (or request a fraction, ``{rollout: 0.01}``). Colocated
placement (``|``) runs the servers on their ranks' bundles: there ``trainer_resources`` places
both and ``server_resources`` is refused. ``CPU``, ``GPU``, ``memory`` and
``object_store_memory`` are the launcher's to request and are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandemrl.launchers.launch_config import LaunchSpec
from tandemrl.launchers.placement import is_colocated

SECTION = "launcher.ray"
RESERVED = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass
class RaySettings:
    """The Ray launcher's own settings (``launcher.ray.*``)."""

    server_resources: dict[str, float] = field(default_factory=dict)
    trainer_resources: dict[str, float] = field(default_factory=dict)


def _resources(table: dict[str, float], key: str) -> dict[str, float]:
    """``launcher.ray.<key>`` (typed by ``configs.launcher``), checked; one-line errors name the key."""
    name = f"{SECTION}.{key}"
    for res, amount in table.items():
        if res in RESERVED:
            raise ValueError(
                f"config key '{name}': '{res}' is requested by the launcher itself; name a custom resource"
            )
        if amount <= 0:
            raise ValueError(f"config key '{name}.{res}' must be a positive number, got {amount!r}")
    return dict(table)


def read_settings(spec: LaunchSpec) -> RaySettings:
    """``launcher.ray.*`` of one trial, checked against its allocation before anything starts."""
    section = spec.launcher.ray
    settings = RaySettings(
        _resources(section.server_resources, "server_resources"),
        _resources(section.trainer_resources, "trainer_resources"),
    )
    if settings.server_resources and is_colocated(spec.allocation):
        raise ValueError(
            f"config key '{SECTION}.server_resources' does not apply to colocated allocation_mode "
            f"'{spec.allocation}': its servers run on their ranks' bundles (use {SECTION}.trainer_resources)"
        )
    if settings.server_resources and spec.allocation.gen is None:
        raise ValueError(f"config key '{SECTION}.server_resources' is set but allocation_mode has no inference servers")
    return settings


def check_offered(settings: RaySettings, nodes: list[dict[str, Any]]) -> None:
    """Fail in one line when no live node offers a requested resource (instead of waiting to be placed)."""
    alive = [n for n in nodes if n.get("Alive")]
    for key, wanted in (
        ("server_resources", settings.server_resources),
        ("trainer_resources", settings.trainer_resources),
    ):
        for res, amount in wanted.items():
            if not any(n.get("Resources", {}).get(res, 0) >= amount for n in alive):
                offered = sorted({r for n in alive for r in n.get("Resources", {}) if not r.startswith("node:")})
                raise RuntimeError(
                    f"{SECTION}.{key}: no live Ray node offers {amount:g} of resource '{res}' "
                    f"(start one with ray start --resources='{{\"{res}\": N}}'; offered: {', '.join(offered)})"
                )


def custom_resources(node_id: str, nodes: list[dict[str, Any]]) -> list[str]:
    """The custom resources a live node offers (what ``ray start --resources`` named it by)."""
    for n in nodes:
        if n.get("NodeID") == node_id:
            skip = (*RESERVED, "node:", "accelerator_type:")
            return sorted(r for r in n.get("Resources", {}) if not r.startswith(skip))
    return []


def node_label(info: dict[str, Any]) -> str:
    """``<node id> (<ip>[, custom resources])`` of a member's recorded node: the resources say which node it was."""
    return f"{info.get('node_id', '?')} ({', '.join([info.get('ip', '?'), *info.get('resources', [])])})"


def is_dead(node_id: str, nodes: list[dict[str, Any]]) -> bool:
    """Whether the cluster has marked ``node_id`` dead."""
    return any(n.get("NodeID") == node_id and not n.get("Alive") for n in nodes)
