"""``--dry-run`` on the local, Ray and Slurm launchers: the batch arithmetic and resolved config, nothing started.

Each launcher runs through its real CLI on the GRPO example with small overrides. What would
show a start: the local launcher's run directory (made before any server), a Ray cluster at an
address where none listens (joining it fails), an ``sbatch`` on PATH that leaves a mark.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_launcher import ENV
from utils import REPO_ROOT, free_port

FIGURES = [
    "prompts per step: 16 (train_dataset.batch_size), 8 per data-parallel rank",
    "samples per step: 64 (x gconfig.n_samples 4), 32 per rank",
    "updates per step: 2 (actor.ppo_n_epochs 1 x actor.ppo_n_minibatches 2), groups of 4, about 16 samples per rank",
    "token budget per micro-batch: 4096 tokens, 12 whole sequences at most; longest sequence 320 tokens "
    "(train_dataset.max_length 256 + gconfig.max_new_tokens 64)",
    "steps per epoch: 6 (100 rows of",
    "total steps: 3 (total_train_steps)",
    "rollout: async, rollout.max_head_offpolicyness 1, rollout.pause_mode abort",
    "episodes in flight: at most 16 per rank ((max_head_offpolicyness 1 + 1) x 8 prompts per rank; "
    "set rollout.max_concurrent_rollouts to cap)",
    "trainer: 2 fsdp ranks (data-parallel 2, tensor 1, pipeline 1)",
    "server watchdog: a server silent 60s is reported, 900s stops the run "
    "(launcher.server_stall_warn, launcher.server_stall_limit)",
    "servers: 1 vllm, 1 devices each, on devices of their own",
]


def _dry_run(
    launcher: str, model: str, data: str, root: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # "tandemrl run" is the console command in front of the local launcher (tandemrl/cli.py).
    head = ["tandemrl", "run"] if launcher == "cli" else [f"tandemrl.launchers.{launcher}"]
    cmd = [sys.executable, "-m", *head, "examples/gsm8k_grpo.py", "--config"]
    cmd += ["examples/gsm8k_grpo.yaml", "--dry-run", f"actor.engine.path={model}", f"train_dataset.path={data}"]
    cmd += [f"cluster.fileroot={root}", "allocation_mode=vllm:d1+fsdp:d2", "train_dataset.batch_size=16"]
    cmd += ["train_dataset.max_samples=100", "actor.ppo_n_minibatches=2", "total_train_steps=3", *extra]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env or ENV, capture_output=True, text=True, timeout=300)


def _check_report(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for figure in FIGURES:
        assert figure in proc.stdout, (figure, proc.stdout[:3000])
    text = proc.stdout.split("resolved config:\n", 1)[1]
    resolved = yaml.safe_load("\n".join(line for line in text.splitlines() if not line.startswith("[launcher]")))
    assert resolved["train_dataset"]["batch_size"] == 16 and resolved["actor"]["group_size"] == 4
    assert resolved["actor"]["ppo_n_minibatches"] == 2 and resolved["allocation_mode"] == "vllm:d1+fsdp:d2"


def test_local_dry_run_starts_nothing(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _dry_run("local", tiny_model_dir, gsm8k_dir, tmp_path / "runs")
    _check_report(proc)
    assert not (tmp_path / "runs").exists()  # a trial makes its run dir before starting any server
    assert "servers healthy" not in proc.stdout and "[launcher] trainer:" not in proc.stdout


def test_dry_run_shows_the_keys_that_differ_from_the_defaults(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """The config part names what the YAML file and the overrides changed, not the ~200 defaults; with
    TANDEMRL_VERBOSE=1 every key."""
    short = _dry_run("local", tiny_model_dir, gsm8k_dir, tmp_path / "runs")
    full = _dry_run("local", tiny_model_dir, gsm8k_dir, tmp_path / "runs", env={**ENV, "TANDEMRL_VERBOSE": "1"})
    shown = [yaml.safe_load(p.stdout.split("resolved config:\n", 1)[1]) for p in (short, full)]
    assert shown[0]["total_train_steps"] == 3 and shown[0]["actor"]["engine"]["path"] == tiny_model_dir
    assert "seed" not in shown[0] and "recover" not in shown[0] and "eps_clip" not in shown[0]["actor"]
    assert shown[1]["seed"] == 1 and shown[1]["recover"]["mode"] == "disabled" and shown[1]["actor"]["eps_clip"] == 0.2
    # every key shown in short has the value the full config has
    assert shown[0]["actor"]["ppo_n_minibatches"] == shown[1]["actor"]["ppo_n_minibatches"] == 2


def test_tandemrl_run_command_is_the_local_launcher(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _dry_run("cli", tiny_model_dir, gsm8k_dir, tmp_path / "runs")
    _check_report(proc)
    assert not (tmp_path / "runs").exists()


def test_ray_dry_run_joins_no_cluster(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    env = {**ENV, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}  # joining would fail: nothing listens there
    proc = _dry_run("ray", tiny_model_dir, gsm8k_dir, tmp_path / "runs", env=env)
    _check_report(proc)
    assert not (tmp_path / "runs").exists()


def test_slurm_dry_run_writes_the_job_but_submits_nothing(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    bin_dir, mark = tmp_path / "bin", tmp_path / "sbatch-ran"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ntouch {mark}\necho 'Submitted batch job 1'\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}"}
    proc = _dry_run("slurm", tiny_model_dir, gsm8k_dir, tmp_path / "runs", "--gpus-per-node", "4", env=env)
    _check_report(proc)
    assert (tmp_path / "runs" / "logs" / "gsm8k-grpo" / "trial0" / "job.sbatch").is_file()
    assert not mark.exists() and "Submitted" not in proc.stdout


def test_a_guard_stops_the_dry_run_with_its_line(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _dry_run("local", tiny_model_dir, gsm8k_dir, tmp_path / "runs", "gconfig.top_p=0.9")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gconfig.top_p'" in lines[0] and "actor.truncation_replay" in lines[0], proc.stderr
    assert "resolved config" not in proc.stdout and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("job", ["arith", "gsm8k"])
def test_main_job_config_dry_run(job: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """scripts/main.sh's configs as shipped (the arithmetic main job, and --gsm8k): each loads, passes the
    guards and names the real model, on the data main.sh gives it (arith: tandemrl.data.arith's output)."""
    config, data, heldout, samples = "examples/gsm8k_grpo_smollm2.yaml", gsm8k_dir, 200, 64
    if job == "arith":  # 4 prompts a step, each group with signal (dynamic sampling), all 500 held-out problems
        config, data, heldout, samples = "examples/arith_grpo_smollm2.yaml", str(tmp_path / "arith"), 500, 32
        subprocess.run([sys.executable, "-m", "tandemrl.data.arith", "--out", data, "--difficulty", "1"], check=True)
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/gsm8k_grpo.py", "--config"]
    cmd += [config, "--dry-run", f"train_dataset.path={data}"]
    cmd += [f"cluster.fileroot={tmp_path / 'runs'}"]
    # Every key (TANDEMRL_VERBOSE): heldout_eval.path is its default, which the short view leaves out.
    env = {**ENV, "TANDEMRL_VERBOSE": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"samples per step: {samples} (x gconfig.n_samples 8)" in proc.stdout, proc.stdout[:3000]
    text = proc.stdout.split("resolved config:\n", 1)[1]
    resolved = yaml.safe_load("\n".join(line for line in text.splitlines() if not line.startswith("[launcher]")))
    assert resolved["actor"]["engine"]["path"] == "smollm2-135m" and resolved["heldout_eval"]["n"] == heldout
    assert resolved["heldout_eval"]["path"] == data
    assert not (tmp_path / "runs").exists()
