"""Where a launcher puts servers and trainer on one machine: devices, CPU threads, server flags.

``+`` in ``allocation_mode`` (disaggregated): on GPUs the servers get the first devices
(``tp*pp`` each) and the trainer the next ``train_world_size``; on CPU each server keeps vLLM's
own binding (one core held back for its front end) and every trainer rank gets one thread.

``|`` (colocated, ``tandemrl.trainers.turns``): servers and trainer see the same devices and
take turns. On GPU the servers start with sleep mode on and a share of the memory
(``gpu_memory_utilization``, default 0.5 here), so the trainer can have the rest while they
sleep. On CPU the servers' ranks bind every core between them (vLLM holds none back for its
front end) and each trainer rank gets ``cores // train_world_size`` threads: whichever side has the turn uses the whole machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tandemrl.api.allocation import AllocationMode

COLOCATED_GPU_MEMORY_UTILIZATION = 0.5


@dataclass
class Placement:
    """Environment and flags for one machine's servers (``server_env[i]``) and trainer."""

    colocated: bool
    server_env: list[dict[str, str]] = field(default_factory=list)
    server_flags: dict[str, Any] = field(default_factory=dict)
    trainer_env: dict[str, str] = field(default_factory=dict)


def is_colocated(alloc: AllocationMode) -> bool:
    return alloc.gen is not None and alloc.train is not None and alloc.colocated(alloc.gen, alloc.train)


def plan_placement(alloc: AllocationMode, gpus: list[str], cpus: list[int]) -> Placement:
    """``gpus``: ids of the visible GPUs (empty: a CPU run); ``cpus``: the cores this process may use."""
    colocated = is_colocated(alloc)
    gen, world = alloc.gen, alloc.train_world_size
    n_servers = gen.strategy.dp if gen else 0
    per_server = gen.strategy.tp * gen.strategy.pp if gen else 0
    plan = Placement(colocated)
    n_gpus = len(gpus)
    if n_gpus:
        need = max(n_servers * per_server, world) if colocated else n_servers * per_server + world
        if need > n_gpus:
            layout = "colocated" if colocated else "disaggregated"
            raise ValueError(f"allocation_mode '{alloc}' needs {need} GPUs ({layout}) but {n_gpus} are visible")
        first_train = 0 if colocated else n_servers * per_server
        plan.server_env = [
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_server : (i + 1) * per_server])} for i in range(n_servers)
        ]
        plan.trainer_env = {
            "CUDA_VISIBLE_DEVICES": ",".join(gpus[first_train : first_train + world]),
            "OMP_NUM_THREADS": "1",
        }
        if colocated:
            plan.server_flags = {"enable_sleep_mode": True, "gpu_memory_utilization": COLOCATED_GPU_MEMORY_UTILIZATION}
        return plan
    plan.server_env = [{} for _ in range(n_servers)]
    threads = 1
    if colocated:
        binds = _split_cores(cpus, n_servers * per_server)
        plan.server_env = [
            {"VLLM_CPU_OMP_THREADS_BIND": "|".join(binds[i * per_server : (i + 1) * per_server])}
            for i in range(n_servers)
        ]
        threads = max(1, len(cpus) // world)
    plan.trainer_env = {"OMP_NUM_THREADS": str(threads)}
    return plan


def _split_cores(cpus: list[int], ranks: int) -> list[str]:
    """``cpus`` in ``ranks`` contiguous chunks as vLLM bind lists ("0,1", ...); cores are shared when too few."""
    cpus = sorted(cpus)
    if ranks > len(cpus):
        return [",".join(map(str, cpus))] * ranks
    size = len(cpus) // ranks
    return [",".join(map(str, cpus[r * size : (r + 1) * size])) for r in range(ranks)]


def visible_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def visible_gpus() -> list[str]:
    """Ids a child should put in ``CUDA_VISIBLE_DEVICES``: the parent's list, else 0..n-1; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
