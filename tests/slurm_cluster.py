"""A real one-node Slurm cluster for the tests: Debian's slurm-wlm on loopback, CPU cores as the resource.

``start_cluster`` installs ``slurm-wlm`` and ``munge`` with apt-get when they are missing (root on
Debian only: ``skip_reason`` says why not elsewhere), then starts, all under one temporary
directory and none of the system's files: a ``munged`` with its own key and socket, ``slurmctld``
and ``slurmd`` in the foreground on free loopback ports, from a generated ``slurm.conf`` (no
cgroups: ``proctrack/linuxproc`` follows every descendant of a step, ``task/none``;
``select/cons_tres`` over the node's cores; no accounting daemon). ``stop_cluster`` cancels what is
left, stops the daemons and any ``slurmstepd`` of this cluster, and removes the directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from utils import free_port

from tandemrl.utils.lifeline import lifeline_command

PACKAGES = ["slurm-wlm", "munge"]
TOOLS = ["slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "munged", "mungekey"]


@dataclass
class SlurmCluster:
    """A running cluster: its config (``SLURM_CONF``), node name, cores, daemons and their logs."""

    root: Path
    conf: Path
    node: str
    cpus: int
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)


def skip_reason() -> str | None:
    """Why the Slurm tests cannot install and run Slurm here, or None."""
    if not os.path.isfile("/etc/debian_version") or shutil.which("apt-get") is None:
        return "a real Slurm cluster needs Debian's slurm-wlm package (apt-get); this machine is not Debian"
    if os.geteuid() != 0:
        return "installing and running slurmctld/slurmd/munged needs root; these tests run as root on CI"
    return None


def install() -> None:
    """``apt-get install slurm-wlm munge`` once per machine; ``apt-get update`` and a retry only if that fails (stale package lists)."""
    if all(shutil.which(t) for t in TOOLS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-q", "--no-install-recommends"]
    quiet = {"env": env, "stdin": subprocess.DEVNULL, "capture_output": True, "text": True, "timeout": 1800}
    proc = subprocess.run([*install_cmd, *PACKAGES], **quiet)
    if proc.returncode != 0:  # stale or missing package lists
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=900", "update", "-q"], **quiet)
        proc = subprocess.run([*install_cmd, *PACKAGES], **quiet)
    missing = [t for t in TOOLS if not shutil.which(t)]
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"apt-get install {' '.join(PACKAGES)} failed (missing {missing}):\n{proc.stderr[-3000:]}")


def _node_cpus() -> int:
    """The node's CPU count as slurmd itself detects it (``slurmd -C``), so the node never drains."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    for word in out.split():
        if word.startswith("CPUs="):
            return int(word.split("=", 1)[1])
    return os.cpu_count() or 1


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (``utils.free_port``, never the same twice)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def write_conf(root: Path, node: str, cpus: int) -> Path:
    """slurm.conf (and an empty cgroup.conf) for one node named ``node`` on 127.0.0.1."""
    conf = root / "slurm.conf"
    ctld_port, slurmd_port = free_ports(2)
    lines = {
        "ClusterName": "tandemrl-test",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": ctld_port,
        "SlurmdPort": slurmd_port,
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root / 'munge' / 'munge.sock'}",
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "slurmctld.pid",
        "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "log" / "slurmctld.log",
        "SlurmdLogFile": root / "log" / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc",  # no cgroups here: follow each step's descendants
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "MpiDefault": "none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",  # cores are the resource (launcher.slurm.device=cpu)
        "ReturnToService": 2,
        "KillWait": 10,
        "SlurmdTimeout": 300,
        "InactiveLimit": 0,
        "NodeName": f"{node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName": f"debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
    }
    conf.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    (root / "cgroup.conf").write_text("IgnoreSystemd=yes\n")
    return conf


def _daemon(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A daemon in the foreground, stopped with its process group if this test process dies."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            lifeline_command(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_cluster(attempts: int = 3) -> SlurmCluster:
    """Install if needed, then start munged, slurmctld and slurmd; returns once the node is idle.

    A daemon whose port another process took between choosing and binding it (a busy machine) is
    retried on fresh ports, ``attempts`` times in all.
    """
    install()
    node, cpus = socket.gethostname().split(".")[0], _node_cpus()  # `hostname -s`: slurmd finds itself by it
    try:  # the job script binds its servers to the node's name
        socket.gethostbyname(node)
    except OSError as err:
        raise RuntimeError(f"slurm test cluster: this machine's name {node!r} does not resolve ({err})") from None
    for attempt in range(attempts):
        root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: munge's socket path must fit 108 bytes
        cluster = SlurmCluster(root, root / "slurm.conf", node, cpus)
        try:
            _start_daemons(cluster)
            return cluster
        except RuntimeError as err:
            stop_cluster(cluster)
            if "Address already in use" not in str(err) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_daemons(cluster: SlurmCluster) -> None:
    root = cluster.root
    root.chmod(0o755)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    write_conf(root, cluster.node, cluster.cpus)
    key, sock = root / "munge" / "munge.key", root / "munge" / "munge.sock"
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True, timeout=60)
    env = cluster.env
    munge = ["munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}", f"--pid-file={root / 'munged.pid'}"]
    munge += [f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}"]
    cluster.daemons.append(_daemon(munge, env, root / "log" / "munged.out.log"))
    _wait(lambda: sock.exists(), 60, "munged did not create its socket", cluster)
    cluster.daemons.append(_daemon(["slurmctld", "-D"], env, root / "log" / "slurmctld.out.log"))
    cluster.daemons.append(_daemon(["slurmd", "-D"], env, root / "log" / "slurmd.out.log"))

    def idle() -> bool:
        return cluster.run("sinfo", "-h", "-N", "-o", "%t").stdout.strip() == "idle"

    _wait(idle, 180, "no idle node", cluster)


def _wait(ready: object, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        dead = [d.args[d.args.index("--") + 1] for d in cluster.daemons if d.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"slurm test cluster: {what} (exited: {dead})\n{cluster.logs()}")
        time.sleep(1)


def _stepds(conf: Path) -> list[psutil.Process]:
    """This cluster's slurmstepd processes (they detach from slurmd; their env names our config)."""
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "slurmstepd" and p.environ().get("SLURM_CONF") == str(conf):
                found.append(p)
        except psutil.Error:
            continue
    return found


def stop_cluster(cluster: SlurmCluster) -> None:
    """Cancel every job, stop the daemons (and stray slurmstepd), remove the directory."""
    if all(d.poll() is None for d in cluster.daemons[:2]) and len(cluster.daemons) == 3:
        cluster.run("scancel", "--user=root")
        try:
            _wait(lambda: not cluster.run("squeue", "-h").stdout.strip(), 120, "jobs left", cluster)
        except RuntimeError:
            pass  # stopped below either way
    for daemon in reversed(cluster.daemons):
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    stray = _stepds(cluster.conf)
    for p in stray:
        p.kill()
    psutil.wait_procs(stray, timeout=30)
    shutil.rmtree(cluster.root, ignore_errors=True)
