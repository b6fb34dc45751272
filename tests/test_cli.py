"""The ``tandemrl`` command: its help, and one-line errors for unknown commands and benches."""

from __future__ import annotations

import subprocess
import sys

from utils import REPO_ROOT

from tandemrl.cli import COMMANDS


def _tandemrl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tandemrl", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_and_its_module() -> None:
    proc = _tandemrl()
    assert proc.returncode == 0, proc.stderr
    for name, (module, _) in COMMANDS.items():
        assert f"  {name} " in proc.stdout and (not module or f"python -m {module}" in proc.stdout), name


def test_eval_help_comes_from_the_eval_module() -> None:
    proc = _tandemrl("eval", "--help")
    assert proc.returncode == 0 and "HF checkpoint directory" in proc.stdout, proc.stdout + proc.stderr


def test_bad_commands_are_one_line_errors() -> None:
    for args, needle in (
        (("trian",), "error: unknown command 'trian' (one of: run, ray, slurm, eval, serve, tinker-serve, bench)"),
        (("bench", "nope"), "error: bench 'nope': no "),
        (("bench",), "error: tandemrl bench NAME [args]: give a bench name"),
        (("tinker-serve", "--model", "/nope"), "error: --model: model directory not found: /nope"),
        (("tinker-serve", "--model", "x", "--api-key", "k"), "error: --api-key: the tinker SDK accepts only keys"),
    ):
        proc = _tandemrl(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
    assert "vs_trl" in _tandemrl("bench", "nope").stderr  # the benches that exist are listed
