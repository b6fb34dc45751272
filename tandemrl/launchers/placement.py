"""Where a launcher puts servers and trainer on one machine: devices, CPU threads, server flags.

``+`` in ``allocation_mode`` (disaggregated): on GPUs the servers get the first devices
(``tp*pp`` each) and the trainer the next ``train_world_size``; on CPU each server keeps vLLM's
own binding (one core held back for its front end) and every trainer rank gets one thread.

``|`` (colocated, ``tandemrl.trainers.turns``): servers and trainer see the same devices and
take turns. On GPU the servers start with sleep mode on and a share of the memory
(``gpu_memory_utilization``, default 0.5 here), so the trainer can have the rest while they
sleep. On CPU the servers' ranks bind every core between them (vLLM holds none back for its
front end) and each trainer rank gets ``cores // train_world_size`` threads: whichever side has the turn uses the whole machine.

Auxiliary servers (inference components other than the generation one, ``vllm[judge]:d1``) sit in
their own ``+`` group: on GPUs they get the devices after the trainer's; on CPU they keep vLLM's own
binding like the generation servers, sharing the cores.

Across nodes (the Ray and Slurm launchers, ``plan_colocated``), server ``i`` shares the devices of
trainer ranks ``i*tp*pp .. (i+1)*tp*pp - 1``, which must sit on one node; each node then gets the
one-machine plan above for its own ranks, their devices and the servers sharing them.
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
    aux_env: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # aux server name -> env per replica


def is_colocated(alloc: AllocationMode) -> bool:
    return alloc.gen is not None and alloc.train is not None and alloc.colocated(alloc.gen, alloc.train)


def _server_shape(alloc: AllocationMode) -> tuple[int, int]:
    """(number of servers, devices per server)."""
    gen = alloc.gen
    return (gen.strategy.dp, gen.strategy.tp * gen.strategy.pp) if gen else (0, 0)


def plan_placement(alloc: AllocationMode, gpus: list[str], cpus: list[int]) -> Placement:
    """``gpus``: ids of the visible GPUs (empty: a CPU run); ``cpus``: the cores this process may use."""
    n_servers, per_server = _server_shape(alloc)
    colocated = is_colocated(alloc)
    plan = plan_machine(alloc, colocated, n_servers, per_server, alloc.train_world_size, gpus, cpus)
    used = (
        max(n_servers * per_server, alloc.train_world_size)
        if colocated
        else n_servers * per_server + alloc.train_world_size
    )
    plan.aux_env = _plan_aux(alloc, gpus, used)
    return plan


def oversubscription(alloc: AllocationMode, gpus: list[str], cpus: list[int]) -> str | None:
    """A one-line warning when a CPU run's devices (server ranks + trainer ranks, apart) outnumber its cores.

    Every device is a process that wants a core of its own; on fewer cores they take turns, so each step
    is slower than with fewer devices. None on GPUs, colocated runs (the sides take turns by design) and
    runs that fit.
    """
    if gpus or is_colocated(alloc):
        return None
    n_servers, per_server = _server_shape(alloc)
    devices = n_servers * per_server + alloc.train_world_size
    devices += sum(c.strategy.dp * c.strategy.tp * c.strategy.pp for c in alloc.aux)
    if devices <= len(cpus):
        return None
    return (
        f"allocation_mode '{alloc}' places {devices} CPU devices (one process each) on {len(cpus)} cores: they "
        f"share cores and each runs slower; use at most {len(cpus)} devices for a faster run"
    )


def _plan_aux(alloc: AllocationMode, gpus: list[str], first: int) -> dict[str, list[dict[str, str]]]:
    """Each auxiliary server replica's env: the GPUs from ``first`` on, one block of tp*pp each; {} on CPU."""
    out: dict[str, list[dict[str, str]]] = {}
    for comp in alloc.aux:
        per, envs = comp.strategy.tp * comp.strategy.pp, []
        for _ in range(comp.strategy.dp):
            if gpus:
                if first + per > len(gpus):
                    raise ValueError(
                        f"allocation_mode '{alloc}' needs {first + per} GPUs with its auxiliary servers "
                        f"but {len(gpus)} are visible"
                    )
                envs.append({"CUDA_VISIBLE_DEVICES": ",".join(gpus[first : first + per])})
                first += per
            else:
                envs.append({})
        out[str(comp.name)] = envs
    return out


def plan_machine(
    alloc: AllocationMode,
    colocated: bool,
    n_servers: int,
    per_server: int,
    world: int,
    gpus: list[str],
    cpus: list[int],
) -> Placement:
    """One machine's plan for ``n_servers`` servers of ``per_server`` devices and ``world`` trainer ranks."""
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
    if not ranks:
        return []
    if ranks > len(cpus):
        return [",".join(map(str, cpus))] * ranks
    size = len(cpus) // ranks
    return [",".join(map(str, cpus[r * size : (r + 1) * size])) for r in range(ranks)]


@dataclass
class RankSlot:
    """Where a trainer rank landed: its node, its GPU ids there (empty on CPU), the node's cores."""

    node: str
    gpus: list[str] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)


@dataclass
class ServerShare:
    """A colocated server: the trainer ranks whose devices it shares, their node, its environment."""

    ranks: list[int]
    node: str
    env: dict[str, str]


@dataclass
class ColocatedPlan:
    """Colocated placement over nodes: every server's share, each node's trainer env, the server flags."""

    servers: list[ServerShare]
    trainer_env: dict[str, dict[str, str]]  # node -> OMP_NUM_THREADS (and CUDA_VISIBLE_DEVICES) of its ranks
    server_flags: dict[str, Any]


def check_colocated_fits(alloc: AllocationMode) -> None:
    """Across nodes every server device is a trainer rank's: fewer trainer ranks than that is an error."""
    n_servers, per_server = _server_shape(alloc)
    if n_servers * per_server > alloc.train_world_size:
        raise ValueError(
            f"allocation_mode '{alloc}': {n_servers * per_server} server devices but {alloc.train_world_size} "
            "trainer ranks; a colocated server shares the devices of tp*pp trainer ranks (give the trainer as many)"
        )


def plan_colocated(alloc: AllocationMode, ranks: list[RankSlot]) -> ColocatedPlan:
    """``ranks`` in rank order, grouped by node: server ``i`` shares ranks ``i*tp*pp ..`` on one node."""
    check_colocated_fits(alloc)
    n_servers, per_server = _server_shape(alloc)
    nodes = list(dict.fromkeys(r.node for r in ranks))
    on_node = {n: [i for i, r in enumerate(ranks) if r.node == n] for n in nodes}
    shares = []
    for s in range(n_servers):
        share = list(range(s * per_server, (s + 1) * per_server))
        node = ranks[share[0]].node
        if any(ranks[r].node != node for r in share) or on_node[node].index(share[0]) % per_server:
            raise ValueError(
                f"allocation_mode '{alloc}': server {s} (tp*pp={per_server}) would share trainer ranks "
                f"{share[0]}-{share[-1]}, which are not {per_server} whole devices of one node; "
                f"give every node a multiple of {per_server} trainer ranks"
            )
        shares.append(ServerShare(share, node, {}))
    plan = ColocatedPlan(shares, {}, {})
    for node in nodes:
        mine = [s for s in shares if s.node == node]
        local = [ranks[i] for i in on_node[node]]
        gpus = [g for r in local for g in r.gpus]
        machine = plan_machine(alloc, True, len(mine), per_server, len(local), gpus, local[0].cpus)
        for server, env in zip(mine, machine.server_env, strict=True):
            server.env = env
        plan.trainer_env[node] = machine.trainer_env
        plan.server_flags = machine.server_flags
    return plan


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
