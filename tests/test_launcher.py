"""The local launcher: GRPO end to end with a real vLLM server, sweeps, teardown, early errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from utils import REPO_ROOT

LAUNCHER = "tandemrl.launchers.local"
LAUNCH = [sys.executable, "-m", LAUNCHER]
ENV = {**os.environ, "WANDB_SILENT": "true", "TANDEMRL_DIST_TIMEOUT": "300", "PYTHONPATH": str(REPO_ROOT)}


def _scalars(tb_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _run(args: list[str], timeout: float, launcher: str = LAUNCHER) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", launcher, *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_grpo_gsm8k_sync_and_async(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _run(
        [
            "examples/gsm8k_grpo.py",
            "--config",
            "examples/gsm8k_grpo.yaml",
            "--multirun",
            "async_training=false,true",
            f"actor.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=3",
            "rollout.max_head_offpolicyness=1",
            "valid_dataset.max_samples=8",
            "gconfig.max_new_tokens=32",
            "saver.freq_steps=3",
            "evaluator.freq_steps=3",
        ],
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for trial, bound in (("trial0_async_trainingfalse", 0), ("trial0_async_trainingtrue", 1)):
        stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / trial)
        assert len(stats["actor/ppo_actor/update/loss"]) >= 3 or len(stats["rollout/reward"]) == 3, sorted(stats)
        # The staleness bound holds at every step (the trainer is at version s at step s);
        # sync is exactly on-policy.
        lags = [s - v for s, v in enumerate(stats["rollout_version_min"])]
        assert len(lags) == 3 and max(lags) <= bound and min(lags) >= 0, lags
        if bound:
            assert max(stats["rollout/staleness/max"]) <= bound
        # Versions advance: after the first update the server produces tokens of newer versions.
        assert stats["rollout_version_max"][-1] >= 1
        assert stats["rollout_version_max"] == sorted(stats["rollout_version_max"])
        assert "eval-rollout/reward" in stats
        ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / trial / "epoch0epochstep2globalstep2"
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(ckpt).config.vocab_size > 0


def _two_async_grpo_steps(
    backend_args: list[str], model: str, data: str, tmp_path: Path, launcher: str = LAUNCHER
) -> str:
    """2 async GRPO steps (staleness bound 1) on a training backend / launcher; returns the trainer log.

    Checks what every backend and launcher must give: two updates and two weight pushes,
    the staleness bound, an eval reward, and a step-1 checkpoint that transformers loads.
    """
    proc = _run(
        [
            "examples/gsm8k_grpo.py",
            "--config",
            "examples/gsm8k_grpo.yaml",
            *backend_args,
            f"actor.path={model}",
            f"train_dataset.path={data}",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=2",
            "async_training=true",
            "rollout.max_head_offpolicyness=1",
            "valid_dataset.max_samples=8",
            "gconfig.max_new_tokens=32",
            "saver.freq_steps=2",
            "evaluator.freq_steps=2",
        ],
        timeout=1200,
        launcher=launcher,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / "trial0")
    assert len(stats["actor/ppo_actor/update/loss"]) == 2 and len(stats["timeperf/update_weights"]) == 2, sorted(stats)
    # Bounded staleness over the weight updates (the trainer is at version s at step s).
    lags = [s - v for s, v in enumerate(stats["rollout_version_min"])]
    assert len(lags) == 2 and 0 <= min(lags) and max(lags) <= 1, lags
    assert max(stats["rollout/staleness/max"]) <= 1
    assert "eval-rollout/reward" in stats
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0" / "epoch0epochstep1globalstep1"
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.vocab_size > 0
    return (tmp_path / "logs" / "gsm8k-grpo" / "trial0" / "trainer.log").read_text()


@pytest.mark.slow
def test_grpo_gsm8k_async_on_deepspeed(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """allocation_mode ``deepspeed:d1``: 2 async GRPO steps on ZeRO-3 with a user's DeepSpeed JSON."""
    ds_json = tmp_path / "ds_config.json"  # the engine owns gradient_clipping: it warns and uses actor's 1.0
    ds_json.write_text(json.dumps({"gradient_clipping": 5.0, "zero_optimization": {"stage": 3}}))
    backend = ["allocation_mode=vllm:d1+deepspeed:d1", "actor.deepspeed.zero_stage=3"]
    trainer_log = _two_async_grpo_steps(
        [*backend, f"actor.deepspeed.config_path={ds_json}"], tiny_model_dir, gsm8k_dir, tmp_path
    )
    # The DeepSpeed engine trained: it read the user's JSON (and overrode the key it owns).
    assert "deepspeed config: 'gradient_clipping' is set by the engine" in trainer_log, trainer_log[-3000:]


@pytest.mark.slow
def test_grpo_gsm8k_async_on_megatron(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """allocation_mode ``megatron:d1``: 2 async GRPO steps, weights pushed from the Megatron engine."""
    trainer_log = _two_async_grpo_steps(["allocation_mode=vllm:d1+megatron:d1"], tiny_model_dir, gsm8k_dir, tmp_path)
    assert "megatron" in trainer_log


@pytest.mark.slow
def test_sft_multirun_sweep_makes_separate_trials(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _run(
        [
            "examples/gsm8k_sft.py",
            "--config",
            "examples/gsm8k_sft.yaml",
            "--multirun",
            "model.optimizer.lr=1e-3,3e-3",
            f"model.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            "train_dataset.max_samples=256",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=3",
            "saver.freq_steps=100",
            "evaluator.freq_steps=100",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = sorted(p.name for p in (tmp_path / "logs" / "gsm8k-sft").iterdir())
    assert trials == ["trial0_lr1e-3", "trial0_lr3e-3"]
    for t in trials:
        assert len(_scalars(tmp_path / "tensorboard" / "gsm8k-sft" / t)["sft/loss"]) == 3
        assert (tmp_path / "logs" / "gsm8k-sft" / t / "trainer.log").stat().st_size > 0
    assert "trial0_lr1e-3" in proc.stdout and "ok" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("allocation_mode=vllm:d1+fsdp:d1p2", "fsdp does not support pipeline parallel"),
        ("actor.path=/no/such/model", "actor.path: model directory not found: /no/such/model"),
    ],
)
def test_bad_input_fails_before_any_process(override: str, expected: str, tmp_path: Path) -> None:
    proc = _run(
        ["examples/gsm8k_grpo.py", "--config", "examples/gsm8k_grpo.yaml", f"cluster.fileroot={tmp_path}", override],
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    # Nothing was started: no server or trainer announced, no run directory created.
    assert "[launcher]" not in proc.stdout
    assert not any(tmp_path.iterdir())


def _is_worker(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "gsm8k_grpo.py" in cmd and "torch.distributed.run" not in cmd


@pytest.mark.slow
def test_killing_the_trainer_leaves_no_process(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        LAUNCH
        + [
            "examples/gsm8k_grpo.py",
            "--config",
            "examples/gsm8k_grpo.yaml",
            f"actor.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=1000",
        ],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    me = psutil.Process(proc.pid)
    for line in proc.stdout:  # the servers are healthy and the trainer has been started
        if "[launcher] trainer:" in line:
            break
    else:
        pytest.fail("launcher ended before starting the trainer")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
    deadline = time.monotonic() + 300
    workers: list[psutil.Process] = []
    while not workers and time.monotonic() < deadline:
        time.sleep(2)
        workers = [p for p in me.children(recursive=True) if _is_worker(p)]
    assert workers, "no trainer worker process appeared"
    time.sleep(20)  # let it get into rollout/training
    family = me.children(recursive=True)
    assert any("vllm" in " ".join(p.cmdline()) for p in family)
    for w in workers:  # the trainer dies mid-run
        w.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=180)
    assert rc != 0
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
