"""One live run per run directory, through the real local launcher (issue 33 item 1); and the launcher's
output relay when the run directory's disk is full (item 3).

A first launch holds its trial's run directory while its trainer runs; a second launch of the same
experiment and trial is refused in one line naming the directory and the first launcher's pid, and starts
nothing. Once the first launcher is killed (-9: no chance to clean up), the directory is free again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher import ENV
from utils import REPO_ROOT


def _args(root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tandemrl.launchers.local",
        "tests/workers/hold_until_released.py",
        "--config",
        "examples/gsm8k_sft.yaml",
        "allocation_mode=fsdp:d1",
        f"cluster.fileroot={root}",
    ]


def start_holding_run(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Launch ``args`` (its own process group) and return once its trainer holds the run: (process, output)."""
    proc = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "holding the run" in line:
            return proc, "".join(seen)
    raise AssertionError("the trainer never started:\n" + "".join(seen)[-3000:])


def test_a_second_launch_on_a_live_run_directory_is_refused(tiny_model_dir: str, tmp_path: Path) -> None:
    args = [*_args(tmp_path), f"model.path={tiny_model_dir}"]
    first, _ = start_holding_run(args)  # the trainer runs: the first launch holds the directory
    try:
        second = subprocess.run(args, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        run_dir = tmp_path / "logs" / "gsm8k-sft" / "trial0"
        expected = f"run directory {run_dir} is in use by a live run (pid {first.pid} on "
        assert second.returncode == 1 and expected in second.stdout, second.stdout[-2000:] + second.stderr[-2000:]
        assert "[trainer]" not in second.stdout and "holding the run" not in second.stdout  # nothing started
        assert first.poll() is None  # the first run goes on
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its lifeline-bound trainer
        first.wait(timeout=60)
    # A dead holder leaves no lock behind: the next launch runs to the end.
    (tmp_path / "release").touch()
    third = subprocess.run(args, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "released" in third.stdout, third.stdout[-2000:] + third.stderr[-2000:]


def test_the_output_relay_survives_an_unwritable_log(capfd: pytest.CaptureFixture[str]) -> None:
    """A trainer.log that cannot be written (``/dev/full``: every write is ENOSPC) is reported once; every line
    of the child still reaches the console and the pipe is drained to its end."""
    from tandemrl.launchers.common import pump

    child = subprocess.Popen([sys.executable, "-c", "for i in range(500): print('line', i)"], stdout=subprocess.PIPE)
    assert child.stdout is not None
    pump(child.stdout, "trainer", Path("/dev/full")).join(timeout=60)
    assert child.wait(timeout=60) == 0
    out = capfd.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("[trainer] ")] == [f"[trainer] line {i}" for i in range(500)]
    lost = [line for line in out if line.startswith("[launcher] ")]
    assert lost == [
        "[launcher] cannot write /dev/full: No space left on device (ENOSPC); its output goes to this console only"
    ]
