"""The layer contracts in pyproject.toml hold, and `lint-imports` would catch a layer violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from utils import REPO_ROOT

LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_contracts_hold() -> None:
    out = _lint(Path(REPO_ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_an_engine_importing_rollout_breaks_the_contracts(tmp_path: Path) -> None:
    shutil.copytree(Path(REPO_ROOT) / "tandemrl", tmp_path / "tandemrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(REPO_ROOT) / "pyproject.toml", tmp_path / "pyproject.toml")
    base = tmp_path / "tandemrl" / "engines" / "base.py"
    base.write_text(base.read_text() + "\nimport tandemrl.rollout.controller  # noqa: E402,F401\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "tandemrl.engines is not allowed to import tandemrl.rollout" in out.stdout, out.stdout[-3000:]
