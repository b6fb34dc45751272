"""The update plan: the ``WeightUpdateMeta`` of a collective update for an allocation.

Serves every training backend (FSDP, DeepSpeed, Megatron): the group holds the trainer head
(rank 0) and every inference rank. ``WeightUpdateMeta.from_disk`` plans a disk update.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Literal

from tandemrl.api.inference import WeightUpdateMeta
from tandemrl.api.net import free_port

if TYPE_CHECKING:
    from tandemrl.api.allocation import AllocationMode


def collective_update(
    allocation: AllocationMode,
    group_addr: str | None = None,
    group_port: int | None = None,
    group_name: str = "tandemrl_weight_update",
    bucket_size_mb: int = 512,
    comm_backend: str | None = None,
    delta: Literal["none", "xor", "sparse"] = "none",
    anchor_every: int = 10,
    dtype: str | None = None,
) -> WeightUpdateMeta:
    """Collective update: 1 trainer head + every inference rank of ``allocation.gen``.

    Unset address/port pick this host's IP and a free port; unset ``comm_backend`` is
    nccl when CUDA is available, else gloo.
    """
    gen = allocation.gen
    if gen is None:
        raise ValueError(f"allocation_mode {allocation} has no inference component for a collective update")
    if comm_backend is None:
        import torch

        comm_backend = "nccl" if torch.cuda.is_available() else "gloo"
    return WeightUpdateMeta(
        type="collective",
        bucket_size_mb=bucket_size_mb,
        group_addr=group_addr or reachable_host_ip(),
        group_port=group_port or free_port(),
        group_name=group_name,
        world_size=1 + gen.world_size,
        comm_backend=comm_backend,
        delta=delta,
        anchor_every=anchor_every,
        dtype=dtype,
    )


def reachable_host_ip() -> str:
    """An address other hosts can reach this one at; loopback if resolution fails."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
