"""The files a run writes as it goes (stats.jsonl, prompt_ids.jsonl, rollout dumps, held-out reports, TensorBoard
events): a failed write names its file.

``open`` puts the path in its OSError; a write on the open file (``f.write``, the flush in ``close``) raises one
without it. On a full disk the rank's ``error:`` line (``tandemrl.utils.cli.error_line``) then said "No space left
on device" and not where: :func:`names_file` gives such an error the path being written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def names_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """An OSError raised inside that names no file is given ``path`` (same exception, same traceback)."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = os.fspath(path)
        raise


def append_text(path: str | os.PathLike[str], text: str) -> None:
    """Append ``text`` to ``path`` (UTF-8, created if missing); an OSError names ``path``."""
    with names_file(path), open(path, "a", encoding="utf-8") as f:
        f.write(text)
