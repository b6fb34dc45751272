"""The Ray launcher on a two-node Ray cluster on this machine: server on one raylet, trainer on the other.

The fixture starts a head (`ray start --head`) and a worker node (`ray start --address`) on this
machine, with their own temp dirs, ports and a custom resource naming the node, and a random token of
their own (token auth, never ~/.ray). All traffic stays on loopback: the head runs as 127.0.0.2 and
the worker node as 127.0.0.3 (`--node-ip-address`). Not 127.0.0.1: for a multi-node cluster Ray rewrites
"localhost"/127.0.0.1 to the machine's outward address, while other loopback addresses are kept. The launcher places
the vLLM server with `launcher.ray.server_resources` and the trainer rank with
`launcher.ray.trainer_resources`. Teardown stops exactly the process trees the fixture started.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from test_launcher import ENV, _grpo_args, _scalars
from utils import REPO_ROOT, free_port

RAY = "tandemrl.launchers.ray"
NODE_A = "tandemrl_test_node_a"  # the head: the vLLM server goes here
NODE_B = "tandemrl_test_node_b"  # the worker node: the trainer rank goes here
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"  # loopback addresses Ray keeps (see the module doc)
PLACE = [f"launcher.ray.server_resources.{NODE_A}=1", f"launcher.ray.trainer_resources.{NODE_B}=1"]
WAIT = 900.0  # generous bound on any condition the tests wait for (never asserted as a duration)


@dataclass
class RayNode:
    """One `ray start --block` process and the processes it started (raylet, agents, GCS on the head)."""

    proc: subprocess.Popen[str]
    temp_dir: str
    resource: str
    family: list[psutil.Process] = field(default_factory=list)

    def raylet(self) -> psutil.Process:
        found = [p for p in self.family if "raylet" in _name(p) and p.is_running()]
        assert len(found) == 1, [_cmd(p) for p in self.family]
        return found[0]

    def stop(self) -> None:
        """Stop this node only: its `ray start` (which stops what it started), then SIGKILL any leftover."""
        family = self.family + _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _start_node(args: list[str], env: dict[str, str], resource: str) -> RayNode:
    """`ray start --block ARGS` with a resource naming the node; returns once Ray says it started."""
    temp_dir = tempfile.mkdtemp(prefix="ray2-")  # short: Ray's unix socket paths must fit 107 bytes
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--num-cpus=2", "--disable-usage-stats"]
    cmd += [f"--resources={json.dumps({resource: 1})}", f"--temp-dir={temp_dir}"]
    cmd += [f"--object-store-memory={128 * 1024**2}", f"--dashboard-agent-listen-port={free_port()}", *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    node = RayNode(proc, temp_dir, resource)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # EOF only if it died
        seen.append(line)
        if "Ray runtime started" in line:
            break
    if proc.poll() is not None:
        node.stop()
        pytest.fail(f"ray start {' '.join(args)} failed:\n" + "".join(seen[-30:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining it
    node.family = _descendants(proc.pid)
    return node


@dataclass
class TwoNodes:
    """A head (NODE_A) and a worker node (NODE_B) of one loopback cluster, and the env that joins it."""

    address: str
    env: dict[str, str]
    head: RayNode
    worker: RayNode | None = None

    def ensure_worker(self) -> RayNode:
        """The worker node, (re)started if a test killed it; returns once the head counts it alive."""
        if self.worker is None or self.worker.proc.poll() is not None or _gone(self.worker.raylet()):
            if self.worker is not None:
                self.worker.stop()
            self.worker = _start_node([f"--address={self.address}", f"--node-ip-address={WORKER_IP}"], self.env, NODE_B)
        _wait_alive_nodes(self.env, 2)
        return self.worker


WAIT_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.5)
print(sum(n["Alive"] for n in ray.nodes()))
"""


def _wait_alive_nodes(env: dict[str, str], n: int) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WAIT_NODES, env["RAY_ADDRESS"], str(n), str(WAIT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT + 120,
    )
    assert out.returncode == 0 and out.stdout.split()[-1:] >= [str(n)], out.stdout[-2000:] + out.stderr[-2000:]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    """Head (127.0.0.2) + worker node (127.0.0.3) with a token of their own (never ~/.ray); stops only what it
    started."""
    port = free_port()
    env = {k: v for k, v in ENV.items() if not k.startswith("RAY_")}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ADDRESS": f"{HEAD_IP}:{port}",
    }
    head_args = [
        "--head",
        f"--node-ip-address={HEAD_IP}",
        f"--port={port}",
        "--include-dashboard=false",
        f"--ray-client-server-port={free_port()}",
    ]
    head = _start_node(head_args, {k: v for k, v in env.items() if k != "RAY_ADDRESS"}, NODE_A)
    cluster = TwoNodes(env["RAY_ADDRESS"], env, head)
    try:
        cluster.ensure_worker()
        yield cluster
    finally:
        if cluster.worker is not None:
            cluster.worker.stop()
        head.stop()


def _placement(run_dir: Path) -> dict[str, dict]:
    return json.loads((run_dir / "placement.json").read_text())


def _assert_on_nodes(run_dir: Path, cluster: TwoNodes, raylet_b: int) -> dict[str, dict]:
    """placement.json: the server's actor is a child of the head's raylet, the rank's of the worker's."""
    where = _placement(run_dir)
    assert sorted(where) == ["rank0", "vllm-server-0"], where
    server, rank = where["vllm-server-0"], where["rank0"]
    assert server["node_id"] != rank["node_id"], where
    assert (server["ip"], rank["ip"]) == (HEAD_IP, WORKER_IP), where  # both nodes on loopback
    assert server["ppid"] == cluster.head.raylet().pid, (where, cluster.head.raylet().pid)
    assert rank["ppid"] == raylet_b, (where, raylet_b)
    return where


@pytest.mark.slow
def test_grpo_server_and_trainer_on_two_ray_nodes(
    two_nodes: TwoNodes, tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """GRPO, 2 async steps: the vLLM server on the head's raylet, the trainer rank on the worker node's."""
    raylet_b = two_nodes.ensure_worker().raylet().pid
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=2, new_tokens=16)
    proc = subprocess.run(
        [sys.executable, "-m", RAY, *args, *PLACE, "async_training=true"],
        cwd=REPO_ROOT,
        env=two_nodes.env,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    where = _assert_on_nodes(run_dir, two_nodes, raylet_b)
    server, rank = (
        f"{where[m]['node_id'][:12]} ({where[m]['ip']}, {n})" for m, n in (("vllm-server-0", NODE_A), ("rank0", NODE_B))
    )
    line = f"[launcher] placement over 2 nodes: vllm-server-0 on {server}; rank0 on {rank}"
    assert line in proc.stdout.splitlines(), proc.stdout[-3000:]
    stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / "trial0")
    assert len(stats["actor/ppo_actor/update/loss"]) == 2 and len(stats["timeperf/update_weights"]) == 2, sorted(stats)
    assert (tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0" / "epoch0epochstep1globalstep1").is_dir()


def _run_processes(run_dir: Path, fileroot: Path) -> list[psutil.Process]:
    """Every process of the run now: the server and rank actors' trees and anything naming the fileroot."""
    found = []
    for member in _placement(run_dir).values():
        try:
            actor = psutil.Process(member["pid"])
        except psutil.Error:
            continue
        found += [actor, *actor.children(recursive=True)]
    found += [p for p in psutil.process_iter() if str(fileroot) in _cmd(p)]
    return list({p.pid: p for p in found}.values())


@pytest.mark.slow
def test_killed_worker_raylet_fails_the_run_in_one_line(
    two_nodes: TwoNodes, tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """SIGKILL the trainer node's raylet after step 1: one error line naming the rank and node, exit 1, no orphans."""
    raylet_b = two_nodes.ensure_worker().raylet()
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=200, new_tokens=16)
    proc = subprocess.Popen(
        [sys.executable, "-m", RAY, *args, *PLACE, "async_training=true", "evaluator.freq_steps=1000"],
        cwd=REPO_ROOT,
        env=two_nodes.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=lambda s=s, b=b: b.extend(s), daemon=True)
        for s, b in ((proc.stdout, out), (proc.stderr, err))
    ]
    for t in readers:
        t.start()
    run_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    stats = run_dir / "stats.jsonl"
    deadline = time.monotonic() + WAIT
    while proc.poll() is None and time.monotonic() < deadline:  # training started: step 1 logged
        if stats.is_file() and stats.read_text().strip():
            break
        time.sleep(0.5)
    assert proc.poll() is None and stats.is_file(), "".join(out)[-4000:] + "".join(err)[-4000:]
    _assert_on_nodes(run_dir, two_nodes, raylet_b.pid)
    processes = _run_processes(run_dir, tmp_path)
    assert any(str(tmp_path) in _cmd(p) for p in processes), [_cmd(p) for p in processes]  # the rank
    assert any("vllm" in _cmd(p) for p in processes), [_cmd(p) for p in processes]  # the server
    raylet_b.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT)
    for t in readers:
        t.join(timeout=60)
    stdout = "".join(out)
    assert proc.returncode == 1, stdout[-4000:] + "".join(err)[-4000:]
    failures = [ln for ln in stdout.splitlines() if "failed:" in ln]
    node = _placement(run_dir)["rank0"]
    lost = f"rank0 lost: Ray node {node['node_id']} ({node['ip']}, {NODE_B}) died"
    assert failures == [f"[launcher] trial trial0 failed: {lost}"], stdout[-4000:]
    _, alive = psutil.wait_procs(processes, timeout=120)
    left = [_cmd(p) for p in alive if not _gone(p)]
    assert not left, left
    assert not [_cmd(p) for p in psutil.process_iter() if str(tmp_path) in _cmd(p) and not _gone(p)]


def _settings(alloc: str, *overrides: str):
    from tandemrl.launchers.launch_config import read_launch_spec
    from tandemrl.launchers.ray_nodes import read_settings

    args = [f"allocation_mode={alloc}", *overrides]
    return read_settings(read_launch_spec(None, args))


def test_node_resource_settings_are_checked_in_one_line() -> None:
    """launcher.ray.*_resources: amounts by resource; bad values, reserved names, colocated servers refused."""
    ok = _settings("vllm:d1+fsdp:d1", *PLACE, "launcher.ray.trainer_resources.gpu_node=0.5")
    assert ok.server_resources == {NODE_A: 1.0} and ok.trainer_resources == {NODE_B: 1.0, "gpu_node": 0.5}
    bad = {
        "launcher.ray.trainer_resources.x=0": "config key 'launcher.ray.trainer_resources.x' must be a positive",
        "launcher.ray.server_resources.GPU=1": "'GPU' is requested by the launcher itself",
        "launcher.ray.server_resources=3": "Config key 'launcher.ray.server_resources' on the command line "
        "('launcher.ray.server_resources=3') expects a mapping, got 3",
        "launcher.ray.trainer_resources.x=some": "'some' of type 'str' could not be converted to Float",
        "launcher.ray.nodes=2": "Unknown config key 'launcher.ray.nodes' on the command line",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError) as err:
            _settings("vllm:d1+fsdp:d1", override)
        assert message in str(err.value) and "\n" not in str(err.value), (override, str(err.value))
    with pytest.raises(ValueError, match="server_resources' does not apply to colocated allocation_mode"):
        _settings("vllm:d1|fsdp:d1", f"launcher.ray.server_resources.{NODE_A}=1")
    assert _settings("vllm:d1|fsdp:d1", f"launcher.ray.trainer_resources.{NODE_B}=1").trainer_resources


def test_a_resource_no_live_node_offers_fails_at_once() -> None:
    from tandemrl.launchers.ray_nodes import RaySettings, check_offered

    nodes = [
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.0, NODE_A: 1.0, "node:10.0.0.1": 1.0}},
        {"NodeID": "b", "Alive": False, "Resources": {}},
    ]
    check_offered(RaySettings({NODE_A: 1.0}, {}), nodes)
    with pytest.raises(RuntimeError, match=f"trainer_resources: no live Ray node offers 1 of resource '{NODE_B}'"):
        check_offered(RaySettings({NODE_A: 1.0}, {NODE_B: 1.0}), nodes)
    with pytest.raises(RuntimeError, match=f"offers 2 of resource '{NODE_A}'.*offered: CPU, {NODE_A}"):
        check_offered(RaySettings({NODE_A: 2.0}, {}), nodes)
