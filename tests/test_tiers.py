"""Every test file has exactly one tier (tests/tiers.py), and the tier reaches its tests as a marker."""

from __future__ import annotations

import subprocess
import sys

from tiers import TIERS
from utils import REPO_ROOT

KNOWN = {"unit", "integration", "e2e"}


def test_every_test_file_has_one_known_tier() -> None:
    files = sorted(p.name for p in (REPO_ROOT / "tests").glob("test_*.py"))
    missing = [f for f in files if f not in TIERS]
    assert not missing, f"test file(s) without a tier: {missing}; add a row to tests/tiers.py"
    gone = sorted(set(TIERS) - set(files))
    assert not gone, f"tests/tiers.py names file(s) that do not exist: {gone}"
    bad = {f: t for f, t in TIERS.items() if t not in KNOWN}
    assert not bad, f"unknown tier(s) {bad}; use one of {sorted(KNOWN)}"


def test_markers_select_by_tier() -> None:
    """`-m unit` collects the unit files' tests and none of the others (what --fast runs)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "unit"]
    cmd += ["tests/test_tiers.py", "tests/test_net.py", "tests/test_turns.py", "tests/test_sft_example.py"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert collected == {"tests/test_tiers.py", "tests/test_net.py"}, out[-2000:]
