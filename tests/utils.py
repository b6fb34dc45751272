"""Helpers shared by tests: free ports and torchrun launches (importable as `from utils import ...`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run `script` (a .py path, or a dotted module name) under torchrun --standalone.

    Children get OMP_NUM_THREADS=1 and the repo on PYTHONPATH. Raises RuntimeError with the
    tail of stdout/stderr if the run fails or times out.
    """
    target = os.fspath(script)
    is_file = target.endswith(".py") or os.path.sep in target
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [target] if is_file else ["-m", target]
    cmd += [str(a) for a in args]
    child_env = dict(os.environ)
    child_env["OMP_NUM_THREADS"] = "1"
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    try:
        proc = subprocess.run(cmd, env=child_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(
            f"torchrun {target} timed out after {timeout}s\n--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun {target} exited with {proc.returncode}\n--- stdout ---\n{_tail(proc.stdout)}\n"
            f"--- stderr ---\n{_tail(proc.stderr)}"
        )
    return proc
