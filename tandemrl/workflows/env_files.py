"""Files of the environment adapters (verifiers, OpenEnv): the row directory they write and the virtualenv they
build for the environment's own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def write_rows(path: str, splits: dict[str, list[dict[str, Any]]], spec_file: str, record: dict[str, Any]) -> None:
    """Write ``<split>.jsonl`` for each split, then ``spec_file`` holding ``record``, each by an atomic rename; the
    record last, so a half-written directory has none and is written again."""
    Path(path).mkdir(parents=True, exist_ok=True)
    files = [(f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows)) for split, rows in splits.items()]
    for name, text in [*files, (spec_file, json.dumps(record))]:
        tmp = Path(path) / f".{name}.{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, Path(path) / name)


def build_venv(root: str, requirements: list[str]) -> str:
    """Build the virtualenv ``root`` with ``requirements`` installed by pip; returns its python."""
    python = os.path.join(root, "bin", "python")
    subprocess.run([sys.executable, "-m", "venv", root], check=True)
    subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements], check=True)
    return python
