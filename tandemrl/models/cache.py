"""The on-disk cache of built models: ``${TANDEMRL_CACHE:-~/.cache/tandemrl}``, one directory per build."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$TANDEMRL_CACHE``, else ``~/.cache/tandemrl`` (tiny models, SmolLM2 and the test suite share it)."""
    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    return Path(root).expanduser()


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` itself (no lock file left behind); the kernel drops it if the
    holder dies."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build_once(final: str | os.PathLike[str], build: Callable[[Path], object]) -> str:
    """``final`` if it exists, else ``build(tmp)`` into a private temp dir renamed to ``final``.

    Callers that race (launcher, trainer ranks, test workers) serialise on a lock of the cache
    directory (builds of different models in it too), so one builds and the others wait and reuse it; the rename keeps a half-written
    directory invisible even to readers that take no lock. Temp dirs left by a killed builder
    are removed by the next one.
    """
    final = Path(final)
    if final.is_dir():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    with _locked(final.parent):
        if final.is_dir():
            return str(final)
        for stale in final.parent.glob(prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
            try:
                os.rename(tmp, final)
            except OSError as e:  # a builder that takes no lock (an older tandemrl) got there first
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
