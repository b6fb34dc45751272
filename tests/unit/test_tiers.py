"""Every test file lives in exactly one tier folder (tests/unit, tests/integration, tests/e2e), and the folder
reaches its tests as a marker (conftest.py): `-m unit` selects tests/unit and nothing else."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import TIERS, tier_of
from utils import REPO_ROOT

TESTS = REPO_ROOT / "tests"


def misplaced(tests: Path) -> list[str]:
    """Test files (``test_*.py`` anywhere under ``tests``) outside the tier folders, and names used twice."""
    files = sorted(tests.rglob("test_*.py"))
    outside = [p.relative_to(tests).as_posix() for p in files if p.parent not in {tests / t for t in TIERS}]
    twice = sorted(name for name, n in Counter(p.name for p in files).items() if n > 1)
    return outside + [f"{name} (in two folders)" for name in twice]


def test_misplaced_finds_files_outside_the_tier_folders(tmp_path: Path) -> None:
    for rel in ("unit/test_a.py", "e2e/test_b.py", "test_root.py", "workers/test_c.py", "integration/test_a.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "utils.py").write_text("")
    assert misplaced(tmp_path) == ["test_root.py", "workers/test_c.py", "test_a.py (in two folders)"]


def test_every_test_file_lives_in_one_tier_folder() -> None:
    bad = misplaced(TESTS)
    assert not bad, f"test file(s) outside tests/unit, tests/integration, tests/e2e or named twice: {bad}"
    counts = Counter(tier_of(p) for p in TESTS.rglob("test_*.py"))
    assert set(counts) == set(TIERS) and sum(counts.values()) >= 100, counts


def test_markers_select_by_folder() -> None:
    """`-m <tier>` collects the tests of that folder's files and none of the others (`-m unit`: what --fast runs)."""
    files = ["tests/unit/test_tiers.py", "tests/unit/test_net.py"]
    files += ["tests/integration/test_turns.py", "tests/e2e/test_sft_example.py"]
    for tier in TIERS:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", tier, *files]
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300).stdout
        collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
        assert collected == {f for f in files if f.startswith(f"tests/{tier}/")}, out[-2000:]
