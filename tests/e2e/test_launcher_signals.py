"""How the local launcher ends when signalled (issue 33 item 5): the exit code is 128 + the signal (130 Ctrl-C,
143 SIGTERM), so a wrapper tells an interrupted run from a failed one (1) or bad input (2); and the console gets
the two summary lines, not the shutdown tracebacks of torchrun and the trainer (they stay in trainer.log)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from test_launcher import ENV
from test_run_lock import _args, start_holding_run
from utils import REPO_ROOT


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_launcher_exits_with_the_signals_code(
    tiny_model_dir: str, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    proc, seen = start_holding_run([*_args(tmp_path), f"model.path={tiny_model_dir}"])
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=120)
    out = seen + rest
    assert proc.returncode == code, out[-3000:]
    assert "[launcher] trial trial0 failed: interrupted" in out, out[-3000:]
    # What the stopping trainer and torchrun print goes to trainer.log, not the console: the summary only.
    assert rest.splitlines() == [
        "[launcher] trial trial0 failed: interrupted",
        f"[launcher] full output: {tmp_path}/logs/gsm8k-sft/trial0/trainer.log",
    ], rest[-3000:]
    bad = subprocess.run(  # bad input, for contrast: 2, before anything starts
        [*_args(tmp_path), "allocation_mode=nonsense"], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
