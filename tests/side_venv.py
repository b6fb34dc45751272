"""A side virtualenv for a test: ``<name>`` under the machine's side-venv cache (``$TANDEMRL_SIDE_VENVS``, default
``~/.cache/tandemrl/side-venvs``) with exactly the given requirements, built by pip from the package index the first
time on a machine and reused (offline) after, by every clone: a fresh clone does not rebuild them (the cookbook's
takes about 3 minutes).

It has no access to the main environment's packages (no ``--system-site-packages``), so a program run with
its python sees the versions installed here and no others. ``python tests/side_venv.py NAME REQ...`` builds one
by hand (the tests call :func:`side_venv`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("TANDEMRL_SIDE_VENVS", "~/.cache/tandemrl/side-venvs")).expanduser()
STAMP = ".tandemrl-side-venv.json"  # what was installed; written last, so a half-built venv is rebuilt


def side_venv(name: str, requirements: list[str], *, timeout: float = 1800.0) -> Path:
    """The python of side venv ``name`` with ``requirements`` installed; builds it if its stamp differs."""
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / name
    python = root / "bin" / "python"
    want = {"requirements": sorted(requirements), "python": sys.version.split()[0]}
    lock_path = CACHE / f"{name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes build one venv once
        stamp = root / STAMP
        if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
            return python
        shutil.rmtree(root, ignore_errors=True)
        log = CACHE / f"{name}.log"
        with open(log, "w") as out:
            steps = [
                [sys.executable, "-m", "venv", str(root)],
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements],
            ]
            for cmd in steps:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
                if rc != 0:
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"building side venv {root}: {' '.join(cmd[:4])} ... exited {rc}:\n{tail}")
        stamp.write_text(json.dumps(want))
        return python


if __name__ == "__main__":
    print(side_venv(sys.argv[1], sys.argv[2:]))
