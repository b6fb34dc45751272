"""A run directory belongs to one live run: an exclusive lock held by the launcher for the trial's life.

``<fileroot>/logs/<experiment>/<trial>/run.lock`` is locked with ``flock`` and holds the holder's pid,
host and start time. The kernel drops the lock when the holder exits in any way (kill -9 included), so
a lock left by a dead run is never in the way; a second launch of the same experiment and trial while
the first lives is refused in one line naming the directory and the holder. The checkpoint directory of
the trial is only written by the run that holds the lock, so ``recover.mode=auto`` never adopts a
checkpoint a live run is writing.

On network filesystems flock is as good as the filesystem's locking (NFSv4 and Lustre with ``flock``
mounts honour it across hosts).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "run.lock"


class RunDirInUse(RuntimeError):
    """Another live run holds this run directory."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {info['pid']} on {info['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block; ``RunDirInUse`` (one line) if a live run holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(
                f"run directory {run_dir} is in use by a live run ({_holder(path)}); wait for it to end, "
                "stop it, or launch with another trial_name"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (a later run overwrites it)
