"""The Slurm launcher: the generated sbatch script's content, its trainer part under torchrun, and
the whole job on a real one-node Slurm cluster (``slurm_cluster``: Debian's slurm-wlm, installed and
started by the module fixture, CPU cores as the devices).

The script tests need no Slurm: ``bash -n`` on the job script and the generated ``trainer.sh`` under
a real torchrun c10d rendezvous with the SLURM_* variables of a one-node job. The cluster tests
submit through ``sbatch`` (GRPO with the vLLM server and the trainer in their own job steps),
``scancel`` a running job, and fail a job step; they skip only where Slurm cannot be installed
(not root, or not Debian).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from slurm_cluster import SlurmCluster, free_ports, skip_reason, start_cluster, stop_cluster
from test_launcher import ENV, _grpo_args, _two_async_grpo_steps
from test_tinker_launcher import sdk_training
from utils import REPO_ROOT, free_port

LAUNCHER = "tandemrl.launchers.slurm"
SLURM = [sys.executable, "-m", LAUNCHER]

ALLREDUCE = """
import json, os, sys
import torch
import torch.distributed as dist
from tandemrl.engines.base import init_default_process_group

init_default_process_group()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")
out = {"sum": t.item(), "argv": sys.argv[1:], "cwd": os.getcwd(), **{k: os.environ.get(k) for k in keys}}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def _slurm(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(SLURM + args, cwd=REPO_ROOT, env=env or ENV, capture_output=True, text=True, timeout=300)


def _config(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"experiment_name": "slurm-test", "cluster": {"fileroot": str(tmp_path)}, **body}))
    return path


def test_sbatch_script_layout_and_settings(tiny_model_dir: str, tmp_path: Path) -> None:
    """3 tp=2 servers + 16 trainer ranks on 8-GPU nodes: 1 server node + 2 trainer nodes."""
    config = _config(
        tmp_path,
        {
            "allocation_mode": "vllm:d3t2+fsdp:d16",
            "actor": {"engine": {"path": tiny_model_dir}},
            "train_dataset": {"batch_size": 32},  # split over the 16 data-parallel ranks
            "launcher": {"slurm": {"partition": "gpu", "gpus_per_node": 8, "sbatch_args": ["--qos=high"]}},
        },
    )
    proc = _slurm(
        ["examples/gsm8k_grpo.py", "--config", str(config), "--dry-run", "--time", "02:00:00"]
        + ["launcher.slurm.account=proj", "--partition", "big", "gconfig.max_new_tokens=16"],
        env={**ENV, "TANDEMRL_SERVER_TOKEN": "submitter-token"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
    assert f"wrote {run_dir / 'job.sbatch'} (3 nodes)" in proc.stdout
    job = (run_dir / "job.sbatch").read_text()
    header = [line for line in job.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=slurm-test_trial0",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --partition=big",  # the CLI flag beats launcher.slurm.partition
        "#SBATCH --time=02:00:00",
        "#SBATCH --account=proj",  # an override of the launcher section
        "#SBATCH --qos=high",
    ]
    assert 'SERVER_NODES=("${NODES[@]:0:1}")' in job and 'TRAINER_NODES=("${NODES[@]:1:2}")' in job
    assert "for i in $(seq 0 2); do" in job and 'node="${SERVER_NODES[$((i / 4))]}"' in job  # 4 tp=2 servers/node
    assert "--gpus-per-task=2 --exact" in job and "-m tandemrl.launchers.serve --backend vllm" in job
    assert f"--model {tiny_model_dir} --tp 2 --pp 1" in job
    assert "export TANDEMRL_LLM_SERVER_ADDRS=" in job
    # Each server step watches its server (tests/integration/test_server_stall.py) and records a stall as the job's failure.
    assert '--stall-warn 60 --stall-limit 900 --step "vllm-server-$i" --failed "$FAILED" &' in job
    # The servers' token is made when the job starts, never written to a file; the submitter's is not forwarded.
    assert 'export TANDEMRL_SERVER_TOKEN="$(' in job and "submitter-token" not in job
    assert "--nodes=2 --ntasks-per-node=1" in job and "--gpus-per-task=8" in job
    assert 'bash "$RUN_DIR/trainer.sh"' in job
    assert subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")], capture_output=True).returncode == 0
    trainer = (run_dir / "trainer.sh").read_text()
    assert "--nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d" in trainer
    assert '--rdzv_endpoint="${TANDEMRL_RDZV_HOST}:29500" --rdzv_id="${SLURM_JOB_ID}"' in trainer
    # The trainer reads the config without the launcher section, user overrides minus launcher.*.
    assert f"--config {run_dir / 'config.yaml'} gconfig.max_new_tokens=16 cluster.n_nodes=3" in trainer
    assert "launcher" not in yaml.safe_load((run_dir / "config.yaml").read_text())
    assert "launcher.slurm" not in trainer


def test_colocated_sbatch_script_puts_servers_on_trainer_nodes(tiny_model_dir: str, tmp_path: Path) -> None:
    """'|': 8 tp=2 servers share the GPUs of 16 trainer ranks on 2 nodes; no server nodes."""
    body = {
        "allocation_mode": "vllm:d8t2|fsdp:d16",
        "async_training": False,  # colocated runs synchronously
        "actor": {"engine": {"path": tiny_model_dir}},
        "train_dataset": {"batch_size": 32},
    }
    proc = _slurm(["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, body)), "--dry-run"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
    assert f"wrote {run_dir / 'job.sbatch'} (2 nodes)" in proc.stdout
    job = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in job and "#SBATCH --gpus-per-node=8" in job
    assert 'TRAINER_NODES=("${NODES[@]:0:2}")' in job and 'SERVER_NODES=("${TRAINER_NODES[@]}")' in job
    # Servers 0-3 on the first trainer node, 4-7 on the second, each on two of its ranks' GPUs.
    assert "SERVER_DEVICES=(0,1 2,3 4,5 6,7 0,1 2,3 4,5 6,7)" in job and 'node="${SERVER_NODES[$((i / 4))]}"' in job
    server_step = next(line for line in job.splitlines() if line.strip().startswith('srun --job-name="vllm-server'))
    assert server_step.strip() == (
        'srun --job-name="vllm-server-$i" --nodes=1 --ntasks=1 --nodelist="$node" --overlap --gpus-per-task=8 \\'
    )
    assert 'env CUDA_VISIBLE_DEVICES="${SERVER_DEVICES[$i]}" ' in job and "--tp 2 --pp 1" in job
    assert """--extra '{"enable_sleep_mode": true, "gpu_memory_utilization": 0.5}'""" in job
    assert '--request-log "$RUN_DIR/vllm-server-$i-requests.jsonl"' in job
    assert "--nodes=2 --ntasks-per-node=1" in job and "--gpus-per-task=8 --overlap --kill-on-bad-exit=1" in job
    assert subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")], capture_output=True).returncode == 0
    trainer = (run_dir / "trainer.sh").read_text()
    assert "--nnodes=2 --nproc_per_node=8" in trainer and "cluster.n_nodes=2 cluster.n_gpus_per_node=8" in trainer


def test_one_node_and_cpu_core_scripts(tiny_model_dir: str, tmp_path: Path) -> None:
    """Server + trainer that fit one node share it in their own steps; device=cpu swaps GPUs for cores."""
    body = {"allocation_mode": "vllm:d1+fsdp:d1", "actor": {"engine": {"path": tiny_model_dir}}}
    run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
    proc = _slurm(["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, body)), "--dry-run"])
    assert proc.returncode == 0 and "(1 nodes)" in proc.stdout, proc.stdout + proc.stderr
    job = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1" in job and "#SBATCH --gpus-per-node=8" in job  # GPUs: Slurm gives each step its own
    assert 'TRAINER_NODES=("${NODES[@]:0:1}")' in job and 'SERVER_NODES=("${TRAINER_NODES[@]}")' in job
    assert '--nodelist="$node" --gpus-per-task=1 --exact' in job and "--gpus-per-task=1 --exact --kill" in job
    cpu = ["launcher.slurm.device=cpu", "launcher.slurm.cpus_per_node=4"]
    proc = _slurm(["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, body)), "--dry-run", *cpu])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=4" in job and "--gpus" not in job
    assert '--nodelist="$node" --cpus-per-task=1 --exact' in job and "--cpus-per-task=1 --exact --kill" in job
    # Colocated on cores: the server binds the node's cores (vLLM CPU), the ranks share its threads.
    colocated = {
        **body,
        "allocation_mode": "vllm:d1|fsdp:d2",
        "async_training": False,
        "train_dataset": {"batch_size": 4},
    }
    proc = _slurm(["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, colocated)), "--dry-run", *cpu])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = (run_dir / "job.sbatch").read_text()
    assert "SERVER_DEVICES=(0,1,2,3)" in job and 'env VLLM_CPU_OMP_THREADS_BIND="${SERVER_DEVICES[$i]}"' in job
    assert "--overlap --cpus-per-task=4" in job
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"' in (run_dir / "trainer.sh").read_text()
    proc = _slurm(["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, body)), "--dry-run", cpu[0]])
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: launcher.slurm.device=cpu needs launcher.slurm.cpus_per_node (cores per node, one a device)"
    )
    proc = _slurm(
        ["examples/gsm8k_grpo.py", "--config", str(_config(tmp_path, body)), "--dry-run", "launcher.slurm.device=tpu"]
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip()
        == "error: Config key 'launcher.slurm.device' on the command line "
        "('launcher.slurm.device=tpu') expects one of gpu, cpu, got 'tpu'"
    )


@pytest.mark.parametrize("mode", ["fsdp:d2", "vllm:d1|fsdp:d2"])
def test_trainer_part_runs_under_torchrun_c10d(mode: str, tiny_model_dir: str, tmp_path: Path) -> None:
    """trainer.sh with a one-node job's SLURM_* env: 2 ranks rendezvous via c10d and all_reduce."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    config = _config(tmp_path, {"allocation_mode": mode, "actor": {"engine": {"path": tiny_model_dir}}})
    port = free_port()
    proc = _slurm(
        [str(script), "--config", str(config), "--dry-run", "--gpus-per-node", "2", f"launcher.slurm.rdzv_port={port}"]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
    assert "#SBATCH --nodes=1" in (run_dir / "job.sbatch").read_text()
    env = {**ENV, "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0"}
    env["TANDEMRL_RDZV_HOST"] = "127.0.0.1"  # the job script sets it to the first trainer node
    run = subprocess.run(["bash", str(run_dir / "trainer.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["sum"] == 3.0
        assert (res["RANK"], res["LOCAL_RANK"], res["WORLD_SIZE"], res["LOCAL_WORLD_SIZE"]) == (
            str(r),
            str(r),
            "2",
            "2",
        )
        assert res["TORCHELASTIC_RUN_ID"] == "4242"  # --rdzv_id from SLURM_JOB_ID
        assert res["argv"] == ["--config", str(config), "cluster.n_nodes=1", "cluster.n_gpus_per_node=2"]
        assert res["cwd"] == str(REPO_ROOT)  # the directory the launcher was called from


def test_missing_sbatch_is_one_line(tiny_model_dir: str, tmp_path: Path) -> None:
    config = _config(tmp_path, {"allocation_mode": "fsdp:d2", "model": {"path": tiny_model_dir}})
    env = {**ENV, "PATH": os.path.dirname(sys.executable)}  # no sbatch on it
    proc = _slurm(["examples/gsm8k_sft.py", "--config", str(config)], env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: sbatch not found on PATH: submit {tmp_path}/logs/slurm-test/trial0/job.sbatch on a Slurm login node, "
        "or use --dry-run"
    ]


def test_shapes_that_do_not_fit_fail_before_writing(tiny_model_dir: str, tmp_path: Path) -> None:
    body = {"allocation_mode": "fsdp:d12", "model": {"path": tiny_model_dir}, "train_dataset": {"batch_size": 24}}
    config = _config(tmp_path, body)
    proc = _slurm(["examples/gsm8k_sft.py", "--config", str(config), "--dry-run", "--gpus-per-node", "8"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: train world size 12 is not a multiple of gpus_per_node 8"
    proc = _slurm(["examples/gsm8k_sft.py", "--config", str(config), "--dry-run", "--gpus-per-node", "x"])
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --gpus-per-node must be an integer, got 'x'"
    colocated = _config(tmp_path, {"allocation_mode": "vllm:d3t2|fsdp:d4", "model": {"path": tiny_model_dir}})
    proc = _slurm(["examples/gsm8k_sft.py", "--config", str(colocated), "--dry-run", "--gpus-per-node", "8"])
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: allocation_mode 'vllm:d3t2|fsdp:d4': 6 server devices but 4 trainer")
    assert not (tmp_path / "logs").exists()


def test_serve_entrypoint_fails_in_one_line_without_publishing(tmp_path: Path) -> None:
    """The job script's per-server step: a bad model is one error line, exit 2 (bad input), and no address file."""
    ready = tmp_path / "servers" / "0.addr"
    cmd = [sys.executable, "-m", "tandemrl.launchers.serve", "--backend", "vllm", "--model", str(tmp_path / "nope")]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--log", str(tmp_path / "s.log"), "--ready", str(ready)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --model: model directory not found: {tmp_path / 'nope'}"
    assert not ready.exists()


# --- on a real one-node Slurm cluster -------------------------------------------------------------------

# A trainer script whose only rank fails at once; run_main records its error for torchrun.
FAILING_TRAINER = """
from tandemrl.utils.cli import run_main


def main(argv):
    raise RuntimeError("boom in the trainer")


run_main(main)
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """One cluster for the module's Slurm tests: installed if missing, started, stopped with no process left."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _on_cluster(cluster: SlurmCluster) -> list[str]:
    """Overrides that put one allocation_mode device on one core of the test node, on free ports."""
    server_port, rdzv_port = free_ports(2)  # distinct
    return [
        "launcher.slurm.device=cpu",
        f"launcher.slurm.cpus_per_node={cluster.cpus}",
        f"launcher.slurm.server_port={server_port}",
        f"launcher.slurm.rdzv_port={rdzv_port}",
    ]


def _job_id(run_dir: Path) -> str:
    outs = list(run_dir.glob("slurm-*.out"))
    assert len(outs) == 1, outs
    return outs[0].stem.split("-", 1)[1]


def _job_processes(job_id: str, root: Path) -> list[psutil.Process]:
    """Live processes of a job: its SLURM_JOB_ID in their environment, or the run's root in their command line."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("SLURM_JOB_ID") == job_id or str(root) in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _until(ready: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not in {timeout} s: {what}"
        time.sleep(1)


def _sigterm_cancels(launcher: subprocess.Popen[str], job_id: str) -> str:
    """SIGTERM to ``--wait``: the launcher cancels the job and exits 143 (interrupted, not failed); its output."""
    launcher.terminate()
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 143, out[-3000:]  # 128 + SIGTERM
    assert f"[launcher] cancelling job {job_id}" in out, out[-3000:]
    return out


def _kill(launcher: subprocess.Popen[str]) -> None:
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()


def _assert_nothing_left(job_id: str, root: Path) -> None:
    """Every process of the job is gone (waited on: a killed process may take a moment to be reaped)."""
    left: list[psutil.Process] = []

    def gone() -> bool:
        left[:] = _job_processes(job_id, root)
        return not left

    deadline = time.monotonic() + 120
    while not gone() and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [(p.pid, " ".join(p.cmdline())[:200]) for p in left if p.is_running()]


@pytest.mark.slow
def test_grpo_two_async_steps_through_sbatch(
    slurm: SlurmCluster, tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch --wait: the vLLM server and the FSDP trainer in their own job steps on one node, 2 async steps."""
    monkeypatch.setitem(ENV, "SLURM_CONF", str(slurm.conf))
    args = ["allocation_mode=vllm:d1+fsdp:d1", *_on_cluster(slurm), "--wait"]
    trainer_log = _two_async_grpo_steps(args, tiny_model_dir, gsm8k_dir, tmp_path, launcher=LAUNCHER)
    assert "grpo done: 2 steps" in trainer_log, trainer_log[-2000:]
    run_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    job_id = _job_id(run_dir)
    job = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1" in job and f"#SBATCH --cpus-per-task={slurm.cpus}" in job  # packed: one node
    assert "--gpus" not in job
    # slurmd launched exactly two steps of this job besides the batch script: server (0), trainer (1).
    launched = (slurm.root / "log" / "slurmd.log").read_text()
    steps = sorted({w.split("=")[1] for w in launched.split() if w.startswith(f"StepId={job_id}.")})
    assert steps == [f"{job_id}.0", f"{job_id}.1"], steps
    server_log = (run_dir / "vllm-server-0.log").read_text()
    assert "Application startup complete" in server_log
    assert f"servers healthy at {slurm.node}:" in (run_dir / f"slurm-{job_id}.out").read_text()
    _assert_nothing_left(job_id, tmp_path)


@pytest.mark.slow
def test_scancel_mid_run_leaves_no_process(
    slurm: SlurmCluster, tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """Colocated, scancel after the first step: every process of the job ends.

    The server and the trainer share the node's cores in `--overlap` steps (sync, the server asleep in
    the trainer's turns); the job is cancelled while both run, after one whole step.
    """
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=1000, new_tokens=32)
    args += ["allocation_mode=vllm:d1|fsdp:d1", "async_training=false", "rollout.max_head_offpolicyness=0"]
    args += [*_on_cluster(slurm), "--wait"]
    env = {**ENV, "SLURM_CONF": str(slurm.conf)}
    launcher = subprocess.Popen(
        SLURM + args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        run_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
        _until(lambda: list(run_dir.glob("slurm-*.out")) or launcher.poll() is not None, 300, "job submitted")
        job_id = _job_id(run_dir)

        def steps() -> set[str]:
            return set(slurm.run("squeue", "-h", "-s", "-j", job_id, "-o", "%j").stdout.split())

        def torchrun_up() -> bool:
            return any("torch.distributed.run" in " ".join(p.cmdline()) for p in _job_processes(job_id, tmp_path))

        _until(lambda: (run_dir / "servers" / "0.addr").exists() or launcher.poll() is not None, 900, "server up")
        _until(lambda: {"vllm-server-0", "trainer"} <= steps() or launcher.poll() is not None, 600, "both steps")
        _until(lambda: torchrun_up() or launcher.poll() is not None, 600, "trainer processes")
        stats = run_dir / "stats.jsonl"  # one whole colocated step: generate, server asleep, train, push, wake
        _until(lambda: (stats.exists() and stats.read_text().strip()) or launcher.poll() is not None, 600, "step 1")
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        family = [" ".join(p.cmdline()) for p in _job_processes(job_id, tmp_path)]
        assert any("vllm.entrypoints" in c for c in family), family  # the server itself, not only serve.py
        assert slurm.run("scancel", job_id).returncode == 0
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1, out[-3000:]
    failures = [line for line in out.splitlines() if "failed:" in line]
    assert failures == [
        f"[launcher] trial trial0 failed: job {job_id} CANCELLED (exit code 0:15; log: {run_dir}/slurm-{job_id}.out)"
    ], out[-3000:]
    _assert_nothing_left(job_id, tmp_path)


def test_failed_job_step_is_one_line_with_its_log(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A trainer rank that raises: the job fails, --wait names the step, the rank's error and the step's log."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_TRAINER)
    config = _config(tmp_path, {"allocation_mode": "fsdp:d1"})
    proc = _slurm(
        [str(script), "--config", str(config), *_on_cluster(slurm), "--wait"],
        env={**ENV, "SLURM_CONF": str(slurm.conf)},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
    job_id = _job_id(run_dir)
    failures = [line for line in proc.stdout.splitlines() if "failed:" in line]
    assert failures == [
        f"[launcher] trial trial0 failed: job {job_id} FAILED: trainer step exited with code 1: "
        f"rank 0: RuntimeError: boom in the trainer (log: {run_dir}/trainer.log)"
    ], proc.stdout[-3000:]
    assert "boom in the trainer" in (run_dir / "trainer.log").read_text()
    _assert_nothing_left(job_id, tmp_path)


def test_interrupted_wait_cancels_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    """SIGTERM to `--wait` while the trainer step runs: the launcher scancels the job, nothing of it is left."""
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(600)\n")
    config = _config(tmp_path, {"allocation_mode": "fsdp:d1"})
    launcher = subprocess.Popen(
        SLURM + [str(script), "--config", str(config), *_on_cluster(slurm), "--wait"],
        cwd=REPO_ROOT,
        env={**ENV, "SLURM_CONF": str(slurm.conf)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_dir = tmp_path / "logs" / "slurm-test" / "trial0"
        trainer_log = run_dir / "trainer.log"
        _until(
            lambda: "up " in (trainer_log.read_text() if trainer_log.exists() else "") or launcher.poll() is not None,
            600,
            "trainer rank up",
        )
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        job_id = _job_id(run_dir)
        out = _sigterm_cancels(launcher, job_id)
    finally:
        _kill(launcher)
    assert "[launcher] trial trial0 failed: interrupted" in out, out
    state = slurm.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
    assert state == "", state  # ended (or already purged): never left running
    _assert_nothing_left(job_id, tmp_path)


@pytest.mark.slow
def test_tinker_serve_job_through_sbatch(slurm: SlurmCluster, tiny_model_dir: str, tmp_path: Path) -> None:
    """examples/tinker_serve.py as a Slurm job (the LoRA-enabled vLLM server and tinker-serve in their own job
    steps): its trainer log names the base URL and key, two cross_entropy steps through the unmodified SDK lower the
    loss, and SIGTERM to ``--wait`` cancels the job with nothing of it left."""
    args = ["examples/tinker_serve.py", "--config", "examples/tinker_serve.yaml", f"model.path={tiny_model_dir}"]
    args += [f"cluster.fileroot={tmp_path}", "tinker.max_adapters=2", "launcher.server_args.max_loras=2"]
    env = {**ENV, "SLURM_CONF": str(slurm.conf), "TINKER_TELEMETRY": "0"}
    launcher = subprocess.Popen(
        SLURM + args + [*_on_cluster(slurm), "--wait"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = re.compile(r"TINKER_BASE_URL=(\S+) TINKER_API_KEY=(\S+)")
    try:
        logs: list[Path] = []

        def serving() -> object:
            logs[:] = list(tmp_path.glob("logs/*/trial0/trainer.log"))
            return (logs and ready.search(logs[0].read_text())) or launcher.poll() is not None

        _until(serving, 900, "tinker-serve ready")
        trainer_log, run_dir = logs[0], logs[0].parent
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        match = ready.search(trainer_log.read_text())
        assert match is not None
        job_id = _job_id(run_dir)
        assert sdk_training(match.group(1), match.group(2), tiny_model_dir) > 0
        _sigterm_cancels(launcher, job_id)
    finally:
        _kill(launcher)
    _assert_nothing_left(job_id, tmp_path)
