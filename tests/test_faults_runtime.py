"""Runtime fault catalogue, through the real local launcher (issue 12).

Each fault asserts: a one-line error naming what failed, a non-zero exit, no orphan
process, and the last good checkpoint intact and loadable. Covered elsewhere (not repeated):

* trainer ranks SIGKILLed -> launcher tears everything down: test_launcher.py::test_killing_the_trainer_leaves_no_process
* GRPO auto-resume at the next step, weights and version restored: test_recover.py
* reward functions that raise, hang, return NaN or strings, one at a time: test_rewards.py
* a server dying mid-run (client side, fake servers): test_remote_engine.py

Here: torchrun alone SIGKILLed (ranks gone, nothing written after), then ``recover.mode=auto``
resuming SFT with per-step losses bitwise equal to an uninterrupted run; an unwritable or
full checkpoint directory; the launcher SIGKILLed (servers and trainer gone).
"""

from __future__ import annotations

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

LAUNCH = [sys.executable, "-m", "tandemrl.launchers.local"]
ENV = {**os.environ, "WANDB_SILENT": "true", "TANDEMRL_DIST_TIMEOUT": "300", "PYTHONPATH": str(REPO_ROOT)}
SFT_STEPS = 6


def _sft_args(model: str, data: str, root: Path, *extra: str) -> list[str]:
    return [
        "examples/gsm8k_sft.py",
        "--config",
        "examples/gsm8k_sft.yaml",
        f"model.path={model}",
        f"train_dataset.path={data}",
        "train_dataset.max_samples=256",
        "train_dataset.batch_size=8",
        f"cluster.fileroot={root}",
        f"total_train_steps={SFT_STEPS}",
        "saver.freq_steps=2",
        "evaluator.freq_steps=1000",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "stats_logger.wandb.mode=disabled",
        *extra,
    ]


def _launch(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(LAUNCH + args, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _losses(tb_dir: Path, tag: str = "sft/loss") -> dict[int, float]:
    """step -> the value written last (a resumed run re-logs the steps after its checkpoint)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    events = []
    for file in tb_dir.glob("events.out.tfevents.*"):
        for ev in EventFileLoader(str(file)).Load():
            for v in ev.summary.value:
                if v.tag == tag:
                    events.append((ev.wall_time, ev.step, float(tensor_util.make_ndarray(v.tensor).item())))
    return {step: value for _, step, value in sorted(events)}


def _family(launcher: psutil.Process) -> list[psutil.Process]:
    return [launcher, *launcher.children(recursive=True)]


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"launcher exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def _files_written_after(root: Path, t_ns: int, skip: set[str]) -> list[str]:
    late = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if name in skip:
                continue
            try:
                if path.lstat().st_mtime_ns > t_ns:
                    late.append(f"{path} (+{(path.lstat().st_mtime_ns - t_ns) / 1e9:.3f}s)")
            except FileNotFoundError:
                continue
    return late


def _assert_hf_checkpoints_load(ckpt_root: Path) -> list[str]:
    """Every checkpoint under its final name loads in transformers; returns their names."""
    from transformers import AutoModelForCausalLM

    names = sorted(p.name for p in ckpt_root.glob("epoch*globalstep*") if not p.name.endswith(".tmp"))
    for name in names:
        assert AutoModelForCausalLM.from_pretrained(ckpt_root / name).config.vocab_size > 0, name
    return names


@pytest.mark.slow
def test_torchrun_alone_killed_then_auto_resume_is_bitwise(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """SIGKILL of torchrun only: every rank is gone at once and writes nothing after; the same
    command with ``recover.mode=auto`` then resumes and the per-step losses equal an
    uninterrupted run's bit for bit (data order, optimizer and LR schedule restored)."""
    ref_root, root = tmp_path / "reference", tmp_path / "killed"
    ref = _launch(_sft_args(tiny_model_dir, gsm8k_dir, ref_root))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _losses(ref_root / "tensorboard" / "gsm8k-sft" / "trial0")
    assert sorted(expected) == list(range(SFT_STEPS))

    args = _sft_args(tiny_model_dir, gsm8k_dir, root)
    proc = subprocess.Popen(
        LAUNCH + args, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    launcher = psutil.Process(proc.pid)
    state = root / "checkpoints" / "gsm8k-sft" / "trial0" / "recover" / "loop_state.json"
    try:
        # The kill lands after the recoverable checkpoint of step 2, somewhere in steps 3-6.
        _wait_for(lambda: '"global_step": 1' in (state.read_text() if state.exists() else ""), 600, "step 2", proc)
        family = _family(launcher)
        torchrun = [p for p in family if "torch.distributed.run" in _cmd(p) and "lifeline" not in _cmd(p)]
        assert len(torchrun) == 1, [_cmd(p) for p in family]
        ranks = torchrun[0].children()
        assert len(ranks) == 2 and all("gsm8k_sft.py" in _cmd(r) for r in ranks), [_cmd(r) for r in ranks]
        torchrun[0].send_signal(signal.SIGKILL)
        _wait_for(lambda: _dead(torchrun[0]), 60, "torchrun to die")
        t_dead = time.time_ns()
        start = time.monotonic()
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived torchrun: {[_cmd(p) for p in alive]}"
        rc = proc.wait(timeout=120)
    finally:
        for p in _family(launcher) if proc.poll() is None else []:
            p.kill()
    rank_exit_s = time.monotonic() - start
    assert rc != 0
    text = "".join(out)
    assert "[launcher] trial trial0 failed: trainer was killed by SIGKILL" in text, text[-3000:]
    # No rank wrote anything once its torchrun was gone (trainer.log is the launcher's copy of their output).
    late = _files_written_after(root, t_dead, skip={"trainer.log"})
    assert not late, late
    ckpts = root / "checkpoints" / "gsm8k-sft" / "trial0"
    assert _assert_hf_checkpoints_load(ckpts)

    resumed = _launch(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    log = (root / "logs" / "gsm8k-sft" / "trial0" / "trainer.log").read_text()
    assert "recover: resumed from" in log, log[-3000:]
    got = _losses(root / "tensorboard" / "gsm8k-sft" / "trial0")
    assert got == expected  # exact float equality, every step
    assert _assert_hf_checkpoints_load(ckpts) == _assert_hf_checkpoints_load(
        ref_root / "checkpoints" / "gsm8k-sft" / "trial0"
    )
    print(f"ranks gone {rank_exit_s:.2f}s after torchrun")
