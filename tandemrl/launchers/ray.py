"""Ray launcher: inference servers and trainer ranks as actors on a Ray cluster.

    python -m tandemrl.launchers.ray SCRIPT --config YAML [key=value ...] [--multirun] [--dry-run]

Same contract as ``tandemrl.launchers.local`` (config read and checked before anything
starts, ``TANDEMRL_LLM_SERVER_ADDRS`` exported, logs in the run directory, teardown on
success, failure or Ctrl-C, ``--multirun`` sweeps, ``--dry-run`` without joining or starting a
cluster), with Ray doing the placement:

* Cluster: ``RAY_ADDRESS`` if set, else a single-node cluster started here and bound to
  loopback, like the local launcher's servers (their weight-update routes have no auth).
  A cluster from ``ray start`` uses token auth: join it with ``RAY_AUTH_MODE=token``.
* Trainer: ``train_world_size`` actors in one placement group (STRICT_PACK when one node
  can hold every rank, else PACK), placed first; each runs SCRIPT in a subprocess with the variables
  torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
  MASTER_ADDR/MASTER_PORT of rank 0's node), which is all ``init_default_process_group``
  reads. Ranks on one node see that node's GPUs in local-rank order, so
  ``cuda:LOCAL_RANK`` is their own GPU. A rank runs under ``utils.lifeline``: it stops with its actor
  (an actor dies with its node).
* Servers: one actor per inference data-parallel replica owns the server subprocess,
  bound to its node's IP, and writes its request log (vLLM). Apart (``+``), it reserves tp*pp
  GPUs when the cluster has GPUs, else tp*pp CPUs. Colocated (``|``, ``launchers.placement``):
  it reserves nothing and runs in the placement group on the bundle of the trainer ranks it
  shares with, its server seeing their GPUs (with sleep mode) or binding their node's cores;
  the ranks start once the servers are healthy.
* Which nodes: ``launcher.ray.server_resources`` / ``launcher.ray.trainer_resources`` (``ray_nodes``)
  are custom resources each server actor / rank bundle requires, so servers and ranks go to the
  nodes started with them. ``placement.json`` in the run directory records each actor's node id,
  IP, custom resources and pid; the launcher prints where each runs when they span nodes.
* The driver polls every actor, prints their output as ``[rank1] ...`` /
  ``[vllm-server-0] ...`` and writes ``trainer.log``; the first rank or server to fail
  stops everything, with a one-line error. An actor lost with its node gives
  ``rank0 lost: Ray node <id> (<ip>, <its custom resources>) died``.

Multi-node runs assume what torchrun/Slurm multi-node runs assume: the script, config,
model and run directory on a shared filesystem and the same Python environment on every
node. The tests run on a one-node CPU cluster and on a two-node one (two ``ray start``
raylets on one machine: server on one, trainer on the other, and the trainer's raylet
killed mid-run); GPU nodes and separate machines are untested.
Ray is imported only when this launcher runs (``import tandemrl`` stays Ray-free).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.api.net import free_port
from tandemrl.inference.remote import SERVER_ADDRS_ENV
from tandemrl.inference.server_auth import TOKEN_ENV, new_token
from tandemrl.launchers import common, dry_run
from tandemrl.launchers.common import LaunchError, TrialResult, guarded_trial, kill_group, write_prefixed
from tandemrl.launchers.launch_config import LaunchSpec, script_config
from tandemrl.launchers.placement import (
    ColocatedPlan,
    RankSlot,
    check_colocated_fits,
    is_colocated,
    plan_colocated,
    visible_cpus,
)
from tandemrl.launchers.ray_nodes import (
    RaySettings,
    check_offered,
    custom_resources,
    is_dead,
    node_label,
    read_settings,
)
from tandemrl.launchers.server_watch import StallBounds, StallClock, stall_error, stall_warning
from tandemrl.utils.cli import first_line
from tandemrl.utils.lifeline import lifeline_command

# Driver variables every actor gets (a remote node's actor starts from its raylet's env).
FORWARD_PREFIXES = (
    "TANDEMRL_",
    "WANDB_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH",
    "NCCL_",
    "GLOO_",
    "VLLM_",
    "SGLANG_",
    "OMP_",
    "MKL_",
    "PYTHONPATH",
)
PLACEMENT_TIMEOUT = float(os.environ.get("TANDEMRL_RAY_PLACEMENT_TIMEOUT", "300"))
POLL_INTERVAL = 0.5
PLACEMENT_FILE = "placement.json"  # in the run directory: where every server and rank actor ran
# How long a dead actor's node may take to be declared dead (GCS health checks) before the error names it.
NODE_LOSS_WAIT = 120.0


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}


def where() -> dict[str, Any]:
    """The calling actor's node id and IP, its pid and its parent's (the node's raylet)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }


class ServerHost:
    """Actor body: owns one inference server subprocess on its node."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self._server: Any = None
        self._offset = 0
        self._stalls: collections.deque[tuple[str, float]] = (
            collections.deque()
        )  # the watch's findings, until taken (oldest first)

    def start(
        self,
        backend: str,
        model_path: str,
        strategy: tuple[int, int],
        extra: dict[str, Any],
        log_file: str,
        request_log: str | None = None,
    ) -> str:
        """Launch the server (``strategy``: tp, pp); returns its address."""
        import ray

        from tandemrl.api.types import ParallelStrategy
        from tandemrl.inference.registry import get_backend
        from tandemrl.inference.server import launch_server

        self._server = launch_server(
            get_backend(backend),
            model_path,
            host=ray.util.get_node_ip_address(),
            strategy=ParallelStrategy(tp=strategy[0], pp=strategy[1]),
            extra=extra,
            log_file=log_file,
            token=os.environ.get(TOKEN_ENV),
            request_log=request_log,
        )
        return str(self._server.address)

    def wait_healthy(self, timeout: float) -> float:
        return float(self._server.wait_healthy(timeout=timeout))

    def watch(self, warn: float, limit: float) -> None:
        """Probe the server's health route from here on (``server_watch.StallClock``); ``take_stall`` reports."""
        bounds = StallBounds(warn, limit)
        clock = StallClock(bounds)

        def run() -> None:
            while self._server is not None and self._server.is_running():
                event = clock.observe(self._server.is_answering(timeout=min(5.0, bounds.every)))
                if event is not None:
                    self._stalls.append(event)
                    if event[0] == "stop":
                        return
                time.sleep(bounds.every)

        threading.Thread(target=run, daemon=True, name="stall-watch").start()

    def take_stall(self) -> tuple[str, float] | None:
        """The oldest finding not handed out yet, ("warn" | "stop", silent seconds), or None: each once, in order."""
        return self._stalls.popleft() if self._stalls else None

    def node(self) -> dict[str, Any]:
        """Where this server landed (``where``) and its server process's pid."""
        return {**where(), "server_pid": self._server.proc.pid if self._server is not None else None}

    def poll(self) -> tuple[list[bytes], int | None, float]:
        """New log lines since the last poll, the exit code once the server is gone, and now."""
        if self._server is None:
            return [], None, 0.0
        rc = self._server.proc.poll()
        try:
            with open(self._server.log_file, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            data = b""
        end = data.rfind(b"\n") + 1 if rc is None else len(data)  # keep a partial line for later
        self._offset += end
        return data[:end].splitlines(keepends=True), rc, time.time()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


class RankHost:
    """Actor body: runs one trainer rank as a subprocess and buffers its output."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._lines: collections.deque[bytes] = collections.deque()
        self._ended = 0.0  # wall time the rank's output closed (it exited): first failure wins

    def node(self) -> dict[str, Any]:
        """Where this rank landed: node id and IP, its GPU ids, the node's cores, a free port for rendezvous."""
        import ray

        here = where()
        return {
            **here,
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "cpus": visible_cpus(),
            "port": free_port(here["ip"]),
        }

    def free_port(self) -> int:
        """A port free on this node now (the rendezvous port, when this is rank 0's actor)."""
        import ray

        return free_port(ray.util.get_node_ip_address())

    def start(self, args: list[str], env: dict[str, str], cwd: str) -> int:
        child_env = {**os.environ, **env}
        self._proc = subprocess.Popen(
            lifeline_command([sys.executable, *args]),  # the rank's group stops if this actor dies with its node
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            cwd=cwd,
            start_new_session=True,  # stop() signals the lifeline, the rank and anything it forked
        )
        self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._reader.start()
        return self._proc.pid

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._lines.extend(iter(proc.stdout.readline, b""))
        self._ended = time.time()

    def poll(self) -> tuple[list[bytes], int | None, float]:
        """Output lines since the last poll, the exit code once the rank is done, and when."""
        if self._proc is None:
            return [], None, 0.0
        rc = self._proc.poll()
        if rc is not None and self._reader is not None:
            self._reader.join(timeout=5)  # the last lines after exit
        lines = []
        while self._lines:
            lines.append(self._lines.popleft())
        return lines, rc, self._ended or time.time()

    def stop(self, grace: float = 15.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            kill_group(self._proc, grace=grace)
        else:  # the rank is gone; anything it forked is still in its session's group
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass
class _Member:
    """A launched actor the driver supervises."""

    name: str  # the output prefix: "rank0", "vllm-server-1"
    actor: Any
    log: Any = None  # trainer.log for ranks; a server's actor writes its own log file
    rc: int | None = None
    ended: float = 0.0
    node: dict[str, Any] = field(default_factory=dict)  # where(): node id, IP, actor pid
    address: str = ""  # a server's host:port


@dataclass
class _Trial:
    """Actors and placement group of one trial; ``stop`` tears them all down."""

    servers: list[_Member] = field(default_factory=list)
    ranks: list[_Member] = field(default_factory=list)
    placement_group: Any = None
    strategy: str = ""  # the placement group's
    infos: list[dict[str, Any]] = field(default_factory=list)  # RankHost.node() per bundle
    settings: RaySettings = field(default_factory=RaySettings)  # launcher.ray.*
    bundles: list[int] = field(default_factory=list)  # bundle index of each rank
    trainer_log: Any = None  # every rank's lines, like the local launcher's trainer.log

    def stop(self) -> None:
        import ray

        for group in (self.ranks, self.servers):
            refs = []
            for m in group:
                try:
                    refs.append(m.actor.stop.remote())
                except Exception:  # the actor is already gone
                    pass
            try:
                ray.wait(refs, num_returns=len(refs), timeout=60)
            except Exception:
                pass
            for m in group:
                try:
                    ray.kill(m.actor)
                except Exception:
                    pass
            group.clear()
        if self.trainer_log is not None:
            self.trainer_log.close()
            self.trainer_log = None
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def _unwrap(err: BaseException) -> BaseException:
    """The user-facing error inside a RayTaskError (its own message starts with a header)."""
    return getattr(err, "cause", None) or err


def _has_gpus() -> bool:
    import ray

    return bool(ray.cluster_resources().get("GPU", 0) > 0)


def _drain(members: list[_Member]) -> None:
    """Print the members' new output; record exit codes. A member whose actor is gone raises its one line."""
    import ray

    refs = [m.actor.poll.remote() for m in members]
    for m, ref in zip(members, refs, strict=True):
        try:
            lines, rc, ended = ray.get(ref, timeout=120)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(_lost_member(m, err)) from None
        for line in lines:
            write_prefixed(line, m.name, m.log)
        if rc is not None and m.rc is None:
            m.rc, m.ended = rc, ended


def _lost_member(m: _Member, err: BaseException) -> str:
    """One line for a member whose actor died: its node's loss when the cluster reports it, else Ray's reason."""
    import ray

    node_id = m.node.get("node_id")
    deadline = time.monotonic() + NODE_LOSS_WAIT
    while node_id:  # an actor dies with its node before the cluster has declared the node dead
        if is_dead(node_id, ray.nodes()):
            return f"{m.name} lost: Ray node {node_label(m.node)} died"
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_INTERVAL)
    return f"{m.name} lost: its Ray actor died: {first_line(_unwrap(err))}"


def _server_actors(
    spec: LaunchSpec, trial: _Trial, env: dict[str, str], gpus: bool, plan: ColocatedPlan | None
) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """Each server actor's Ray options and environment.

    Apart: its own tp*pp GPUs (or CPU slots) and ``launcher.ray.server_resources``. Colocated: no resources of its own, on the bundle of
    the first trainer rank it shares with, with the placement plan's device/core variables.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gen = spec.allocation.gen
    assert gen is not None
    if plan is None:
        per_server = gen.strategy.tp * gen.strategy.pp
        opts: dict[str, Any] = (
            {"num_gpus": per_server, "num_cpus": 1} if gpus else {"num_gpus": 0, "num_cpus": per_server}
        )
        if trial.settings.server_resources:
            opts["resources"] = dict(trial.settings.server_resources)
        return [(opts, {"OMP_NUM_THREADS": "1", **env})] * gen.strategy.dp
    actors = []
    for share in plan.servers:
        bundle = trial.bundles[share.ranks[0]]
        where = PlacementGroupSchedulingStrategy(trial.placement_group, placement_group_bundle_index=bundle)
        actors.append(({"num_gpus": 0, "num_cpus": 0, "scheduling_strategy": where}, {**env, **share.env}))
    return actors


def _start_servers(
    spec: LaunchSpec, run_dir: Path, trial: _Trial, env: dict[str, str], gpus: bool, plan: ColocatedPlan | None
) -> list[str]:
    import ray

    gen = spec.allocation.gen
    if gen is None:
        return []
    host_cls = ray.remote(ServerHost)
    extra = {**(plan.server_flags if plan else {}), **spec.server_extra}
    starts = []
    for i, (opts, actor_env) in enumerate(_server_actors(spec, trial, env, gpus, plan)):
        actor: Any = host_cls.options(max_concurrency=4, **opts).remote(actor_env)  # a Ray handle
        name = f"{gen.backend}-server-{i}"
        trial.servers.append(_Member(name, actor))
        request_log = str(run_dir / f"{name}-requests.jsonl") if TOKEN_ENV in env else None  # vLLM only
        strategy = (gen.strategy.tp, gen.strategy.pp)
        starts.append(
            actor.start.remote(gen.backend, spec.model_path, strategy, extra, str(run_dir / f"{name}.log"), request_log)
        )
    ready, _ = ray.wait(starts, num_returns=len(starts), timeout=PLACEMENT_TIMEOUT)
    if len(ready) < len(starts):
        raise RuntimeError(
            f"{len(starts) - len(ready)} of {len(starts)} {gen.backend} servers could not be placed in "
            f"{PLACEMENT_TIMEOUT:.0f}s; cluster resources: {ray.cluster_resources()}"
        )
    addrs = ray.get(starts)
    for m, address in zip(trial.servers, addrs, strict=True):
        m.address = address
    nodes = ray.nodes()
    for m, info in zip(trial.servers, ray.get([m.actor.node.remote() for m in trial.servers]), strict=True):
        m.node = {**info, "resources": custom_resources(info["node_id"], nodes)}
    pending = {m.actor.wait_healthy.remote(spec.server_timeout): m for m in trial.servers}
    while pending:
        done, _ = ray.wait(list(pending), timeout=POLL_INTERVAL)
        _drain(trial.servers)
        for ref in done:
            pending.pop(ref)
            ray.get(ref)  # raises the server's error (exited, not healthy in time)
    ray.get(
        [m.actor.watch.remote(spec.launcher.server_stall_warn, spec.launcher.server_stall_limit) for m in trial.servers]
    )
    return addrs


def _rank_layout(infos: list[dict[str, Any]]) -> list[int]:
    """Bundle index of each rank: ranks grouped by node (rank 0's node first), bundle order within."""
    node_order = list(dict.fromkeys(info["node_id"] for info in infos))
    return sorted(range(len(infos)), key=lambda b: (node_order.index(infos[b]["node_id"]), b))


def _rank_envs(infos: list[dict[str, Any]], gpus: bool) -> list[dict[str, str]]:
    """torchrun's per-rank variables for the ranks in ``_rank_layout`` order."""
    order = _rank_layout(infos)
    nodes = list(dict.fromkeys(infos[b]["node_id"] for b in order))
    per_node = {n: [b for b in order if infos[b]["node_id"] == n] for n in nodes}
    master = infos[order[0]]
    envs = []
    for rank, b in enumerate(order):
        node = infos[b]["node_id"]
        local = per_node[node]
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local.index(b)),
            "WORLD_SIZE": str(len(order)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": str(nodes.index(node)),
            "NODE_RANK": str(nodes.index(node)),
            "MASTER_ADDR": master["ip"],
            "MASTER_PORT": str(master["port"]),
        }
        if gpus:  # the node's GPUs in local-rank order: cuda:LOCAL_RANK is this rank's own
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for x in local for g in infos[x]["gpus"])
        envs.append(env)
    return envs


def _place_ranks(spec: LaunchSpec, run_dir: Path, trial: _Trial, env: dict[str, str], gpus: bool) -> None:
    """The placement group and one idle rank actor per bundle; ``trial.infos`` says where each landed."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = spec.allocation.train_world_size
    wanted = trial.settings.trainer_resources  # launcher.ray.trainer_resources: which nodes may hold ranks
    bundle = {"CPU": 1, "GPU": 1, **wanted} if gpus else {"CPU": 1, **wanted}
    unit = "GPU" if gpus else "CPU"
    hosts = [n for n in ray.nodes() if n.get("Alive") and all(n["Resources"].get(r, 0) >= a for r, a in wanted.items())]
    biggest = max((n["Resources"].get(unit, 0) for n in hosts), default=0)
    trial.strategy = "STRICT_PACK" if biggest >= world else "PACK"
    trial.placement_group = placement_group([bundle] * world, strategy=trial.strategy)
    try:
        ray.get(trial.placement_group.ready(), timeout=PLACEMENT_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"no room for {world} trainer ranks ({bundle} each, {trial.strategy}) in {PLACEMENT_TIMEOUT:.0f}s; "
            f"available: {ray.available_resources()}"
        ) from None
    host_cls = ray.remote(RankHost)
    actors: list[Any] = [  # Ray handles
        host_cls.options(
            num_cpus=1,
            num_gpus=1 if gpus else 0,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(trial.placement_group, placement_group_bundle_index=b),
        ).remote(env)
        for b in range(world)
    ]
    trial.infos = ray.get([a.node.remote() for a in actors], timeout=PLACEMENT_TIMEOUT)
    nodes = ray.nodes()
    for info in trial.infos:
        info["resources"] = custom_resources(info["node_id"], nodes)
    trial.bundles = _rank_layout(trial.infos)
    trial.trainer_log = open(run_dir / "trainer.log", "ab")
    trial.ranks = [
        _Member(f"rank{r}", actors[b], trial.trainer_log, node=trial.infos[b]) for r, b in enumerate(trial.bundles)
    ]


def _colocated_plan(spec: LaunchSpec, trial: _Trial) -> ColocatedPlan | None:
    """The placement plan of servers sharing the placed ranks' devices; None when they run apart."""
    if not is_colocated(spec.allocation):
        return None
    ranks = [trial.infos[b] for b in trial.bundles]
    return plan_colocated(spec.allocation, [RankSlot(i["node_id"], i["gpus"], i["cpus"]) for i in ranks])


def _start_ranks(trial: _Trial, env: dict[str, str], gpus: bool, args: list[str], plan: ColocatedPlan | None) -> None:
    """Run SCRIPT on every placed rank with torchrun's variables (and the plan's thread count)."""
    import ray

    # The rendezvous port is probed now, not at placement: the servers' minute of start-up in between
    # gave other processes time to take a port probed then (EADDRINUSE in rank 0's TCPStore).
    trial.infos[trial.bundles[0]]["port"] = ray.get(trial.ranks[0].actor.free_port.remote(), timeout=PLACEMENT_TIMEOUT)
    rank_envs = []
    for b, renv in zip(trial.bundles, _rank_envs(trial.infos, gpus), strict=True):
        threads = plan.trainer_env[trial.infos[b]["node_id"]]["OMP_NUM_THREADS"] if plan else "1"
        rank_envs.append({"OMP_NUM_THREADS": threads, **env, **renv, "PYTHONUNBUFFERED": "1"})  # a user's wins
    ray.get([m.actor.start.remote(args, e, os.getcwd()) for m, e in zip(trial.ranks, rank_envs, strict=True)])
    master = rank_envs[0]
    print(
        f"[launcher] trainer: {len(trial.ranks)} ranks on {len(set(i['node_id'] for i in trial.infos))} node(s) "
        f"({trial.strategy}), master {master['MASTER_ADDR']}:{master['MASTER_PORT']}: {' '.join(args)}",
        flush=True,
    )


def _record_placement(trial: _Trial, run_dir: Path) -> None:
    """Write ``placement.json`` (each server's and rank's node id, IP and actor pid) and print where each runs."""
    members = trial.servers + trial.ranks
    (run_dir / PLACEMENT_FILE).write_text(json.dumps({m.name: m.node for m in members}, indent=1) + "\n")
    nodes = {m.node["node_id"] for m in members}
    if len(nodes) > 1:  # on one node the trainer line says it all
        where_ = "; ".join(f"{m.name} on {node_label({**m.node, 'node_id': m.node['node_id'][:12]})}" for m in members)
        print(f"[launcher] placement over {len(nodes)} nodes: {where_}", flush=True)


def _supervise(trial: _Trial, run_dir: Path, spec: LaunchSpec) -> tuple[int, str]:
    """Stream output until every rank exits 0, or the first rank/server failure (a server that stopped
    answering its health route past ``launcher.server_stall_limit`` included)."""
    import ray

    members = trial.ranks + trial.servers
    bounds = StallBounds(spec.launcher.server_stall_warn, spec.launcher.server_stall_limit)
    while True:
        _drain(members)
        for m in trial.servers:
            if m.rc is not None:
                return 1, f"{m.name} exited with code {m.rc} during training (log: {run_dir / (m.name + '.log')})"
        for m, event in zip(trial.servers, ray.get([m.actor.take_stall.remote() for m in trial.servers]), strict=True):
            who = f"{spec.allocation.gen_backend} server {m.address}"
            if event is not None and event[0] == "stop":
                return 1, stall_error(who, event[1])
            if event is not None:
                print(f"[launcher] {stall_warning(who, event[1], bounds)}", flush=True)
        failed = [m for m in trial.ranks if m.rc not in (None, 0)]
        if failed:  # the first to exit is the cause; the others died of its absence
            m = min(failed, key=lambda m: m.ended)
            return 1, f"{m.name} exited with code {m.rc} (log: {run_dir / 'trainer.log'})"
        if all(m.rc == 0 for m in trial.ranks):
            return 0, ""
        time.sleep(POLL_INTERVAL)


def run_trial(script: str, config_path: str | None, overrides: list[str], spec: LaunchSpec) -> TrialResult:
    """Place the ranks, start the servers, then the ranks' scripts; supervise; tear all down whatever happens."""
    import ray

    trial = _Trial(settings=read_settings(spec))

    def body(run_dir: Path) -> tuple[int, str]:
        check_offered(trial.settings, ray.nodes())
        gpus = _has_gpus()
        env = forwarded_env()  # OMP_NUM_THREADS only if the user set it: ranks get theirs in _start_ranks
        env.pop(TOKEN_ENV, None)
        gen = spec.allocation.gen
        if gen is not None and "token" in gen.features:  # servers listen on node IPs: a fresh token per run
            env[TOKEN_ENV] = new_token()
        _place_ranks(spec, run_dir, trial, env, gpus)
        plan = _colocated_plan(spec, trial)
        addrs = _start_servers(spec, run_dir, trial, env, gpus, plan)
        if addrs:
            env[SERVER_ADDRS_ENV] = ",".join(addrs)
            print(f"[launcher] {spec.allocation.gen_backend} servers healthy at {env[SERVER_ADDRS_ENV]}", flush=True)
        # The script's config lacks the launcher section; absolute paths: a rank runs in the driver's cwd,
        # which may be another node's mount.
        config, kept = script_config(config_path, overrides, str(run_dir.resolve() / "config.yaml"))
        args = [os.path.abspath(script)] + (["--config", config] if config else []) + kept
        _start_ranks(trial, env, gpus, args, plan)
        _record_placement(trial, run_dir)
        return _supervise(trial, run_dir, spec)

    def body_unwrapped(run_dir: Path) -> tuple[int, str]:
        try:
            return body(run_dir)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
            raise RuntimeError(first_line(_unwrap(err))) from None

    return guarded_trial(spec, overrides, body_unwrapped, trial.stop)


def connect(specs: list[tuple[list[str], LaunchSpec]]) -> bool:
    """Join ``RAY_ADDRESS``'s cluster, or start a loopback one-node cluster; True if we own it."""
    if not os.environ.get("RAY_ADDRESS"):
        # A cluster started here is single-node: keep Ray (and the servers) on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as err:  # Ray's own message is a traceback chain; its root cause says why
            root: BaseException = err
            while root.__cause__ is not None:
                root = root.__cause__
            why = first_line(root).split(" Last connection error")[0][:300]
            raise LaunchError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {why}") from None
        return False
    need = 0
    for _, spec in specs:
        alloc = spec.allocation
        gen_world = alloc.gen.world_size if alloc.gen else 0
        world = alloc.train_world_size
        # Colocated servers take no slots of their own: they run on their ranks' bundles.
        need = max(need, max(world, gen_world) if is_colocated(alloc) else world + gen_world)
    # Ray's CPUs are scheduling slots: give one per actor even on a 2-core machine.
    ray.init(
        num_cpus=max(os.cpu_count() or 1, need),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,  # only small control messages travel through it
    )
    return True


def main(argv: list[str]) -> int:
    args = common.parse_args(argv, "tandemrl.launchers.ray", flags=("--multirun", dry_run.FLAG))
    specs = common.plan_trials(args)
    if not specs:  # finished already (said)
        return 0
    common.refuse_local_only(specs, "ray")
    for _, spec in specs:
        read_settings(spec)  # launcher.ray.*: a bad value fails before anything starts
        if is_colocated(spec.allocation):
            check_colocated_fits(spec.allocation)  # before any actor starts
    if dry_run.FLAG in args.flags:
        return 0
    owned = connect(specs)
    try:
        return common.run_trials(args, specs, run_trial)
    finally:
        if owned:
            import ray

            ray.shutdown()


def cli() -> None:
    common.cli(main)


if __name__ == "__main__":
    # Run the importable module, so actor classes pickle by reference, not as __main__.
    from tandemrl.launchers.ray import cli as _cli

    _cli()
