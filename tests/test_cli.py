"""The ``tandemrl`` command: its help, and one-line errors for unknown commands and benches."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


def _no_tokenizer_copy(model_dir: str, dest: Path) -> Path:
    """A model directory with its config and weights but none of its tokenizer files."""
    dest.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / name, dest / name)
    return dest


def test_bad_eval_and_serve_arguments_are_one_line_errors(tiny_model_dir: str, tmp_path: Path) -> None:
    """Bad arguments to ``eval`` and ``serve`` print one ``error:`` line (no usage block) and exit 2; a model
    directory without a tokenizer is refused before any server starts (the server would log its start)."""
    bare = _no_tokenizer_copy(tiny_model_dir, tmp_path / "bare")
    for args, needle in (
        (("eval", tiny_model_dir, "--n", "-5"), "error: python -m tandemrl.eval: --n must be >= 1, got -5"),
        (("serve",), "error: tandemrl serve: the following arguments are required: --model"),
        (("serve", "--model", str(tmp_path / "nope")), f"error: --model: model directory not found: {tmp_path}/nope"),
        (("serve", "--model", str(bare)), f"error: --model: {bare} has no tokenizer (none of tokenizer.json"),
        (("eval", str(bare), "--out", str(tmp_path / "r.json")), f"error: tokenizer: {bare} has no tokenizer"),
    ):
        proc = _tandemrl(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
        assert "server" not in proc.stdout, proc.stdout  # '[eval] vLLM server pid ...' / '[serve] ... starting'
