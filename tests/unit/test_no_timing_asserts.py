"""No test depends on how fast the machine is: no wall-clock duration is compared with a number.

A *clock reading* is a call to ``time()``, ``monotonic()`` or ``perf_counter()`` (their ``_ns``
forms too, however imported, e.g. ``time.monotonic()`` or ``loop.time()``), a name bound to one, or
one plus an offset (a deadline). A *duration* is a difference with a clock reading on either side, a
name bound to one (``elapsed``, ``dt``, ``took``...), arithmetic on one, or a timing statistic (a
``"timeperf/..."`` or ``"...seconds"`` key). Reported, anywhere under tests/:

- a comparison of a duration with anything but a bare 0 (``elapsed < 0.9``, ``1.0 <= dt < 4.0``,
  ``dt - 5 < 0``, ``dt == pytest.approx(1)``), also through assert helpers (``assertLess(dt, 1)``,
  ``math.isclose(dt, 1)``); ``dt > 0`` ("it was measured") cannot depend on speed and is allowed;
- a clock reading stored in a tuple, list, set or dict (a recorded timestamp, to be compared later:
  order events with a counter instead).

Waiting with a deadline (``while not done() and time.monotonic() < deadline``) compares two clock
readings, not a duration with a number, and is fine. Speed is measured in bench/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from utils import REPO_ROOT

CLOCKS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
THROUGH = {"abs", "round", "min", "max", "float", "int", "sum", "approx"}  # a duration stays one
CHECKS = {"isclose", "allclose"}  # besides assert* helpers


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


class _Scan:
    """The clock and duration names of one module (names are not scoped: a clash only over-reports)."""

    def __init__(self, tree: ast.Module) -> None:
        self.clocks: set[str] = set()
        self.durations: set[str] = set()
        for _ in range(3):  # names bound from names bound earlier
            for node in ast.walk(tree):
                value = getattr(node, "value", None)
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) or value is None:
                    continue
                names = [n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)]
                if self.duration(value):
                    self.durations.update(names)
                elif self.clock(value):
                    self.clocks.update(names)

    def clock(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Call):
            return _name(node.func) in CLOCKS and not node.args
        if isinstance(node, ast.Name):
            return node.id in self.clocks
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.clock(node.left) != self.clock(node.right)  # a reading plus an offset: a deadline
        return False

    def duration(self, node: ast.expr) -> bool:
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Sub) and (self.clock(node.left) or self.clock(node.right)):
                return True
            return self.duration(node.left) or self.duration(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.duration(node.operand)
        if isinstance(node, ast.Call) and _name(node.func) in THROUGH:
            return any(self.duration(a) for a in node.args)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
            return isinstance(key, str) and (key.startswith("timeperf/") or key.endswith("seconds"))
        return isinstance(node, ast.Name) and node.id in self.durations

    def pure(self, node: ast.expr) -> bool:
        """A duration made of clock readings and durations only (no number mixed in)."""
        if isinstance(node, ast.BinOp):
            return all(self.clock(n) or self.pure(n) for n in (node.left, node.right))
        if isinstance(node, ast.UnaryOp):
            return self.pure(node.operand)
        if isinstance(node, ast.Call):
            return _name(node.func) in THROUGH and all(self.pure(a) for a in node.args)
        return self.duration(node)

    def threshold(self, operands: list[ast.expr]) -> bool:
        """Whether these compared values hold a duration and something other than a bare 0."""
        timed = [o for o in operands if self.duration(o)]
        return bool(timed) and not (
            all(self.pure(o) for o in timed) and all(_is_zero(o) for o in operands if o not in timed)
        )


def find_timing_asserts(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: code`` of every duration threshold and recorded timestamp in ``source``."""
    tree = ast.parse(source, filename=filename)
    scan = _Scan(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            bad = scan.threshold([node.left, *node.comparators])
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            bad = (name.startswith("assert") or name in CHECKS) and scan.threshold(node.args)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            bad = any(v is not None and scan.clock(v) for v in ast.iter_child_nodes(node))
        else:
            continue
        if bad:
            found.append((node.lineno, f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}"))
    return [text for _, text in sorted(found)]


BAD = """
import time, asyncio, math, pytest
from time import monotonic as mono, perf_counter
start = time.monotonic()
t0 = perf_counter()
elapsed = time.monotonic() - start
dt = round(elapsed, 2)
took = mono() - t0
assert time.monotonic() - start < 0.9
assert 1.0 <= elapsed < 4.0
assert dt < 3
assert took * 1000 < 50
assert elapsed - 5 < 0
assert elapsed == pytest.approx(1.0, abs=0.5)
assert time.perf_counter() - t0 >= 0.05 + 0.1
assert 0.02 <= out["timeperf/step"] < 5.0
assert failed_at - start < config["request_timeout"]
self.assertLess(time.time() - start, 2)
ok = math.isclose(asyncio.get_running_loop().time() - t0, 1.0)
events.append(("woke", time.time()))
"""

GOOD = """
import time
deadline = time.monotonic() + 30
while not done() and time.monotonic() < deadline:
    time.sleep(0.01)
start = time.perf_counter()
elapsed = time.perf_counter() - start
assert elapsed > 0 and 0 <= elapsed
assert stats["timeperf/update"] > 0.0 and len(stats["timeperf/update"]) == 2
assert stats["loss"] < 0.9 and lag <= k
print(f"took {elapsed:.2f}s")
"""


def test_finds_every_kind_of_duration_threshold() -> None:
    found = find_timing_asserts(BAD)
    lines = [int(f.split(":")[1]) for f in found]
    assert lines == list(range(9, 21)), "\n".join(found)  # one report per line, none from the bindings
    assert find_timing_asserts(GOOD) == []


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "tests").rglob("*.py")), ids=lambda p: p.name)
def test_no_test_compares_a_duration_with_a_number(path: Path) -> None:
    found = find_timing_asserts(path.read_text(encoding="utf-8"), path.relative_to(REPO_ROOT).as_posix())
    assert not found, "assert an event, a counter or an order instead; measure speed in bench/:\n" + "\n".join(found)
