"""The Slurm launcher: the generated sbatch script's content, and its trainer part run for real.

There is no Slurm here: srun/sbatch/scontrol never run. What runs is ``bash -n`` on the
job script and the generated ``trainer.sh`` under a real torchrun c10d rendezvous, with the
SLURM_* variables a one-node job would give it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_launcher import ENV
from utils import REPO_ROOT, free_port

SLURM = [sys.executable, "-m", "tandemrl.launchers.slurm"]

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
    assert "SERVER_GPUS=(0,1 2,3 4,5 6,7 0,1 2,3 4,5 6,7)" in job and 'node="${SERVER_NODES[$((i / 4))]}"' in job
    server_step = next(line for line in job.splitlines() if line.strip().startswith("srun --nodes=1"))
    assert server_step.strip() == 'srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --gpus-per-task=8 \\'
    assert 'env CUDA_VISIBLE_DEVICES="${SERVER_GPUS[$i]}" ' in job and "--tp 2 --pp 1" in job
    assert """--extra '{"enable_sleep_mode": true, "gpu_memory_utilization": 0.5}'""" in job
    assert '--request-log "$RUN_DIR/vllm-server-$i-requests.jsonl"' in job
    assert "--nodes=2 --ntasks-per-node=1" in job and "--gpus-per-task=8 --overlap --kill-on-bad-exit=1" in job
    assert subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")], capture_output=True).returncode == 0
    trainer = (run_dir / "trainer.sh").read_text()
    assert "--nnodes=2 --nproc_per_node=8" in trainer and "cluster.n_nodes=2 cluster.n_gpus_per_node=8" in trainer


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
    assert proc.returncode == 2 and proc.stderr.strip() == "error: gpus_per_node must be an integer, got 'x'"
    colocated = _config(tmp_path, {"allocation_mode": "vllm:d3t2|fsdp:d4", "model": {"path": tiny_model_dir}})
    proc = _slurm(["examples/gsm8k_sft.py", "--config", str(colocated), "--dry-run", "--gpus-per-node", "8"])
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: allocation_mode 'vllm:d3t2|fsdp:d4': 6 server devices but 4 trainer")
    assert not (tmp_path / "logs").exists()


def test_serve_entrypoint_fails_in_one_line_without_publishing(tmp_path: Path) -> None:
    """The job script's per-server step: a bad model is one error line, exit 1, and no address file."""
    ready = tmp_path / "servers" / "0.addr"
    cmd = [sys.executable, "-m", "tandemrl.launchers.serve", "--backend", "vllm", "--model", str(tmp_path / "nope")]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--log", str(tmp_path / "s.log"), "--ready", str(ready)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: launch_server: model_path '{tmp_path / 'nope'}' does not exist"
    assert not ready.exists()
