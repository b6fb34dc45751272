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


_EXCERPT = re.compile(r"^```py[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _excerpts() -> list[tuple[str, int, str]]:
    """(page, block number, body) of every ```py block of docs/*.md: training-script excerpts not run here."""
    return [
        (page.name, i, m.group(1))
        for page in sorted((REPO_ROOT / "docs").glob("*.md"))
        for i, m in enumerate(_EXCERPT.finditer(page.read_text(encoding="utf-8")), start=1)
    ]


def test_script_excerpts_compile_and_their_imports_resolve() -> None:
    """Each ```py excerpt is valid python, and every ``from M import N`` / ``import M`` it shows names a module
    and a name that exist (a renamed function or a wrong module path fails here, not in a user's script)."""
    import ast
    import importlib.util

    excerpts = _excerpts()
    assert len(excerpts) >= 5
    imported = 0
    for page, i, body in excerpts:
        tree = ast.parse(body, filename=f"docs/{page} py block {i}")  # a SyntaxError names page and block
        for node in ast.walk(tree):
            names: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [(node.module, [a.name for a in node.names if a.name != "*"])]
            elif isinstance(node, ast.Import):
                names = [(a.name, []) for a in node.names]
            for module_name, attrs in names:
                if module_name.split(".")[0] != "tandemrl":  # the user's own modules and third-party ones
                    continue
                spec = importlib.util.find_spec(module_name)
                assert spec is not None, f"docs/{page} py block {i}: no module {module_name}"
                module = importlib.import_module(module_name)
                missing = [
                    n
                    for n in attrs
                    if not hasattr(module, n) and importlib.util.find_spec(f"{module_name}.{n}") is None
                ]
                assert not missing, f"docs/{page} py block {i}: {module_name} has no {missing}"
                imported += 1
    assert imported >= 10, imported
