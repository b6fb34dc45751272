"""Size guard: no module in tandemrl/ over 800 lines (rollout/: 450), no function or method over 80 lines.

A function's length counts its ``def`` line through its last line (decorators excluded). What is
over a limit today is listed in ALLOWED with its current length; the list may only shrink: the test
also fails when a listed item has grown, is back within the limit, or is gone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from utils import REPO_ROOT

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
PACKAGE = REPO_ROOT / "tandemrl"

# {"path/from/repo/root.py" or "path.py::Qualified.name": current length}. Shrink only.
ALLOWED: dict[str, int] = {}


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, line count) of every function and method, nested ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            found.append((name, node.end_lineno - node.lineno + 1))
            found += _functions(node, name + ".<locals>.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, prefix + node.name + ".")
        else:
            found += _functions(node, prefix)
    return found


def measure(root: Path) -> dict[str, int]:
    """Every module under ``root`` over MAX_MODULE_LINES and every function over MAX_FUNCTION_LINES."""
    sizes: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            sizes[rel] = len(text.splitlines())
        for name, length in _functions(ast.parse(text, filename=rel)):
            if length > MAX_FUNCTION_LINES:
                sizes[f"{rel}::{name}"] = length
    return sizes


def _body(indent: int, n: int) -> str:
    return "\n".join(" " * indent + f"x{i} = {i}" for i in range(n))


def test_measure_finds_long_functions_and_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    limit = MAX_FUNCTION_LINES
    lines = ["class C:", "    def ok(self):", _body(8, limit - 1), "    def long(self):", _body(8, limit)]
    lines += ["def outer():", "    def inner():", _body(8, limit), "    return inner", ""]
    (pkg / "a.py").write_text("\n".join(lines))
    (pkg / "b.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (pkg / "c.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert measure(pkg) == {
        "pkg/a.py::C.long": limit + 1,
        "pkg/a.py::outer": limit + 3,
        "pkg/a.py::outer.<locals>.inner": limit + 1,
        "pkg/c.py": MAX_MODULE_LINES + 1,
    }


def test_modules_and_functions_stay_small() -> None:
    sizes = measure(PACKAGE)
    new = {k: v for k, v in sizes.items() if k not in ALLOWED}
    grown = {k: (ALLOWED[k], v) for k, v in sizes.items() if k in ALLOWED and v > ALLOWED[k]}
    assert not new, (
        f"over the limits ({MAX_MODULE_LINES}-line modules, {MAX_FUNCTION_LINES}-line functions); split them: {new}"
    )
    assert not grown, f"allowlisted items grew (allowed, now): {grown}"


def test_allowlist_only_shrinks() -> None:
    sizes = measure(PACKAGE)
    stale = {k: v for k, v in ALLOWED.items() if k not in sizes}
    shrunk = {k: (v, sizes[k]) for k, v in ALLOWED.items() if k in sizes and sizes[k] < v}
    assert not stale, f"within the limits or gone now: remove from ALLOWED in tests/unit/test_code_shape.py: {stale}"
    assert not shrunk, f"shorter now: lower their entries in ALLOWED (allowed, now): {shrunk}"


# The rollout rooms (feed, episodes, executor; docs/architecture.md) each stay well inside the module limit,
# so the next async feature lands in the room it belongs to rather than in one crowded file.
MAX_ROLLOUT_LINES = 450


def test_rollout_modules_stay_under_their_own_limit() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "rollout").glob("*.py")}
    assert {"feed.py", "episodes.py", "executor.py"} <= set(sizes)
    assert {name: n for name, n in sizes.items() if n > MAX_ROLLOUT_LINES} == {}
