"""A side virtualenv for a test: ``.venv-<name>`` at the repo root (git-ignored) with exactly the given
requirements, built by pip from the package index the first time and reused (offline) after.

It has no access to the main environment's packages (no ``--system-site-packages``), so a program run with
its python sees the versions installed here and no others. ``python tests/side_venv.py NAME REQ...`` builds one
by hand (the tests call :func:`side_venv`).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STAMP = ".tandemrl-side-venv.json"  # what was installed; written last, so a half-built venv is rebuilt


def side_venv(name: str, requirements: list[str], *, timeout: float = 1800.0) -> Path:
    """The python of ``.venv-<name>`` with ``requirements`` installed; builds it if its stamp differs."""
    root = REPO_ROOT / f".venv-{name}"
    python = root / "bin" / "python"
    want = {"requirements": sorted(requirements), "python": sys.version.split()[0]}
    lock_path = REPO_ROOT / f".venv-{name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes build one venv once
        stamp = root / STAMP
        if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
            return python
        shutil.rmtree(root, ignore_errors=True)
        log = REPO_ROOT / f".venv-{name}.log"
        with open(log, "w") as out:
            steps = [
                [sys.executable, "-m", "venv", str(root)],
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements],
            ]
            for cmd in steps:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
                if rc != 0:
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"building .venv-{name}: {' '.join(cmd[:4])} ... exited {rc}:\n{tail}")
        stamp.write_text(json.dumps(want))
        return python


if __name__ == "__main__":
    print(side_venv(sys.argv[1], sys.argv[2:]))
