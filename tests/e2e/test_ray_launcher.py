"""The Ray launcher on a real one-node Ray cluster: rendezvous, colocated GRPO end to end, teardown (apart GRPO on
two nodes: tests/e2e/test_ray_two_nodes.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_colocated import assert_no_generation_during_turns
from test_launcher import ENV, _grpo_args, _run
from utils import REPO_ROOT, free_port

RAY = "tandemrl.launchers.ray"

ALLREDUCE = """
import json, os, sys
import torch
import torch.distributed as dist
from tandemrl.engines.base import init_default_process_group

init_default_process_group()  # reads only what the launcher exported: RANK, MASTER_ADDR...
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TANDEMRL_PROBE")
out = {"sum": t.item(), "backend": dist.get_backend(), "argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}
print("sum", t.item(), flush=True)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""

# Rank 1 fails; rank 0 would sleep for 10 minutes: only the launcher's teardown ends it.
FAILING = """
import os, sys, time
print("up", os.environ["RANK"], os.getpid(), flush=True)
if os.environ["RANK"] == "1":
    time.sleep(3)
    print("rank 1 gives up", flush=True)
    sys.exit(3)
time.sleep(600)
"""


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _script(tmp_path: Path, body: str) -> tuple[Path, Path]:
    """The script and a config with a 2-rank, training-only allocation (no model needed)."""
    script = tmp_path / "script.py"
    script.write_text(body)
    config = tmp_path / "config.yaml"
    config.write_text(f"allocation_mode: fsdp:d2\nexperiment_name: ray-test\ncluster:\n  fileroot: {tmp_path}/runs\n")
    return script, config


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[str]:
    """A separate `ray start --head` cluster (loopback, 4 CPU slots); yields its address."""
    port = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("TANDEMRL_PROBE", None)
    ray_bin = Path(sys.executable).parent / "ray"
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's unix socket paths must fit 107 bytes
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=4", "--disable-usage-stats"]
        + ["--include-dashboard=false", f"--object-store-memory={256 * 1024**2}", f"--temp-dir={temp_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    family: list[psutil.Process] = []
    try:
        assert head.stdout is not None
        seen = []
        for line in head.stdout:  # EOF only if it died
            seen.append(line)
            if "Ray runtime started" in line:
                break
        assert head.poll() is None, "ray start --head failed:\n" + "".join(seen)
        threading.Thread(target=head.stdout.read, daemon=True).start()  # keep draining it
        family = psutil.Process(head.pid).children(recursive=True)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("cluster", ["launcher-started", "RAY_ADDRESS"])
def test_two_ranks_rendezvous_and_all_reduce(cluster: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """2 trainer actors get torchrun's env, join one gloo world and all_reduce; logs land in the run dir."""
    script, config = _script(tmp_path, ALLREDUCE)
    env = {**ENV, "TANDEMRL_PROBE": "forwarded"}
    if cluster == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_head")
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the driver joins the loopback head as a local node
        env["RAY_AUTH_MODE"] = "token"  # `ray start` enables token auth; a client must opt in to send it
    else:
        env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", RAY, str(script), "--config", str(config), "extra.key=1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["sum"] == 3.0 and res["backend"] == "gloo"  # 1 + 2 across both ranks
        assert (res["RANK"], res["LOCAL_RANK"], res["WORLD_SIZE"], res["LOCAL_WORLD_SIZE"]) == (
            str(r),
            str(r),
            "2",
            "2",
        )
        assert res["argv"] == ["--config", str(config), "extra.key=1"]
        assert res["TANDEMRL_PROBE"] == "forwarded"  # the driver's env reaches the actors
    assert results[0]["MASTER_ADDR"] == results[1]["MASTER_ADDR"] == "127.0.0.1"
    assert results[0]["MASTER_PORT"] == results[1]["MASTER_PORT"]
    assert "[rank0] sum 3.0" in proc.stdout and "[rank1] sum 3.0" in proc.stdout
    log = (tmp_path / "runs" / "logs" / "ray-test" / "trial0" / "trainer.log").read_text()
    assert log.count("sum 3.0") == 2


@pytest.mark.slow
def test_colocated_grpo_on_ray_never_generates_during_training(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """'|' through Ray: the server actor shares rank 0's bundle, binds every core and sleeps in each trainer turn."""
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=2, new_tokens=16)
    proc = _run([*args, "allocation_mode=vllm:d1|fsdp:d1", "async_training=false"], timeout=1200, launcher=RAY)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ranks on 1 node(s)" in proc.stdout
    assert_no_generation_during_turns(tmp_path / "logs" / "gsm8k-grpo" / "trial0", steps=2)


def test_failing_rank_tears_everything_down(tmp_path: Path) -> None:
    """Rank 1 exits 3: rank 0 is killed, the launcher's Ray cluster stopped, one error line, rc != 0."""
    script, config = _script(tmp_path, FAILING)
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", RAY, str(script), "--config", str(config)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    me = psutil.Process(proc.pid)
    pids: dict[str, int] = {}
    family: list[psutil.Process] = []
    names: list[str] = []
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.split()[1:2] == ["up"]:  # "[rankN] up N PID"
            pids[line.split()[2]] = int(line.split()[3])
            if len(pids) == 2:  # both ranks run: everything the trial started exists now
                family = me.children(recursive=True)
                names = [_cmd(p) for p in family]
                break
    assert len(pids) == 2, "".join(lines)
    out, err = proc.communicate(timeout=180)
    lines.append(out)
    stdout = "".join(lines)
    assert proc.returncode == 1, stdout[-3000:] + err[-3000:]
    failures = [ln for ln in stdout.splitlines() if "failed:" in ln]
    assert failures == [
        f"[launcher] trial trial0 failed: rank1 exited with code 3 (log: {tmp_path}/runs/logs/ray-test/trial0/trainer.log)"
    ], stdout[-3000:]
    assert any(p.pid in pids.values() for p in family) and any("raylet" in n for n in names), names
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    # rank 0 was killed in its 600 s sleep: neither rank is left
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids.values())
