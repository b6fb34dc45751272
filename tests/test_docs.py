"""The docs' python snippets run as written: each page's ```python blocks, in order, as one script.

Blocks fenced ```py are excerpts of training scripts (they need inference servers) and
are not run; yaml/bash/text blocks are not python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from utils import REPO_ROOT

DOCS = ("customize_dataset.md", "customize_workflow.md", "customize_algorithm.md")
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(markdown: str) -> list[str]:
    """Bodies of the ```python fenced blocks, in order."""
    return [m.group(1) for m in _FENCE.finditer(markdown)]


def test_python_blocks_extracts_only_python_fences() -> None:
    md = "x\n```python\na = 1\n```\n```py\nnot_run()\n```\n```yaml\nk: v\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(md) == ["a = 1\n", "b = a + 1\n"]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_snippets_run(doc: str, tmp_path: Path) -> None:
    blocks = python_blocks((REPO_ROOT / "docs" / doc).read_text(encoding="utf-8"))
    assert len(blocks) >= 2, f"docs/{doc} should show runnable python"
    script = tmp_path / f"{Path(doc).stem}.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "TANDEMRL_DIST_TIMEOUT": "120"}
    # Not under torchrun: engines make a world of one on a free port of their own.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"docs/{doc} snippets failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
