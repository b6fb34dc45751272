"""The ``tandemrl`` command: its help, and one-line errors for unknown commands and benches."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
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
        (("bench", "weight_sync", "--nope"), "error: weight_sync.py: unrecognized arguments: --nope"),
        (
            ("run", "examples/gsm8k_grpo.py", "--config", "examples/gsm8k_grpo.yaml", "rollout.server_addrs=[h:99999]"),
            "error: Config key 'rollout.server_addrs' on the command line",
        ),
        (("tinker-serve", "--model", "/nope"), "error: --model: model directory not found: /nope"),
        (("tinker-serve", "--model", "x", "--api-key", "k"), "error: --api-key: the tinker SDK accepts only keys"),
    ):
        proc = _tandemrl(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
    assert "vs_trl" in _tandemrl("bench", "nope").stderr  # the benches that exist are listed


def _servers() -> set[int]:
    """The pids of the vLLM server and tinker-serve processes alive now."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "vllm.entrypoints" in cmd or "tinker-serve" in cmd:
            found.add(p.info["pid"])
    return found


def _no_tokenizer_copy(model_dir: str, dest: Path) -> Path:
    """A model directory with its config and weights but none of its tokenizer files."""
    dest.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / name, dest / name)
    return dest


def test_bad_eval_and_serve_arguments_are_one_line_errors(tiny_model_dir: str, tmp_path: Path) -> None:
    """Bad arguments to ``eval``, ``serve`` and ``tinker-serve`` print one ``error:`` line (no usage block, no
    traceback) and exit 2 before any server starts: a model directory without a tokenizer, a port out of range
    or taken, a dtype or backend the server does not take. No vLLM server or tinker-serve process was started."""
    bare = _no_tokenizer_copy(tiny_model_dir, tmp_path / "bare")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    taken, before = listener.getsockname()[1], _servers()
    for args, needle in (
        (("eval", tiny_model_dir, "--n", "-5"), "error: python -m tandemrl.eval: --n must be >= 1, got -5"),
        (("serve",), "error: tandemrl serve: the following arguments are required: --model"),
        (("serve", "--model", str(tmp_path / "nope")), f"error: --model: model directory not found: {tmp_path}/nope"),
        (("serve", "--model", str(bare)), f"error: --model: {bare} has no tokenizer (none of tokenizer.json"),
        (("eval", str(bare), "--out", str(tmp_path / "r.json")), f"error: tokenizer: {bare} has no tokenizer"),
        # Ports, dtypes and backends are checked before a server starts (they failed 9-29 s later, in vLLM).
        (("eval", tiny_model_dir, "--dtype", "float64"), "error: --dtype: vLLM servers take one of auto, bfloat16,"),
        (("serve", "--model", tiny_model_dir, "--port", "99999"), "error: --port: must be 0 (a free one) or a port in"),
        (("serve", "--model", tiny_model_dir, "--port", str(taken)), f"error: --port: {taken} is in use on 127.0.0.1"),
        (("serve", "--model", tiny_model_dir, "--dtype", "float64"), "error: --dtype: vllm servers take one of auto,"),
        (("serve", "--model", tiny_model_dir, "--backend", "tgi"), "error: --backend: unknown inference backend 'tgi'"),
        (("serve", "--model", tiny_model_dir, "--extra", '{"max_num_seq": 4}'), "error: --extra: vllm servers have no"),
        (("tinker-serve", "--model", tiny_model_dir, "--port", "-1"), "error: --port: must be 0 (a free one) or a"),
        (("tinker-serve", "--model", tiny_model_dir, "--port", str(taken)), f"error: --port: {taken} is in use on"),
    ):
        proc = _tandemrl(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
        assert "server" not in proc.stdout, proc.stdout  # '[eval] vLLM server pid ...' / '[serve] ... starting'
    assert _servers() <= before  # no server process of these commands is left
    listener.close()
