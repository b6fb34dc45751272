"""docs/architecture.md names every package of tandemrl and says what it may import, as the import
contracts of pyproject.toml (which `lint-imports` enforces) allow it.

A new package without a row in the page's table, a row for a package that is gone, or a row whose
"may import" list differs from the contracts fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from utils import REPO_ROOT

PACKAGE_DIR = REPO_ROOT / "tandemrl"
DOC = REPO_ROOT / "docs" / "architecture.md"
_ROW = re.compile(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$")


def packages(root: Path = PACKAGE_DIR) -> list[str]:
    """The top-level packages of tandemrl (folders with an __init__.py)."""
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def nested_packages(root: Path = PACKAGE_DIR) -> list[str]:
    """Packages inside the top-level ones, as `parent/child/`."""
    return sorted(
        f"{p.parent.relative_to(root).as_posix()}/"
        for p in root.glob("*/*/__init__.py")
        if p.parent.parent.parent == root
    )


def doc_table(text: str) -> dict[str, set[str]]:
    """package -> the packages its row says it may import (empty for 'nothing of tandemrl')."""
    section = text.split("## What each package may import", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = _ROW.match(line.strip())
        if m and m.group(1) != "package":
            assert m.group(1) not in rows, f"docs/architecture.md has two rows for `{m.group(1)}`"
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    return rows


def allowed_imports(pyproject: Path = REPO_ROOT / "pyproject.toml") -> dict[str, set[str]]:
    """package -> the packages the import-linter contracts let it import: every lower layer, minus
    what a `forbidden` contract names for it."""
    contracts = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    # The packages' layers (a layers contract inside one package, e.g. rollout's rooms, names modules: a.b.c).
    (layers_contract,) = [
        c
        for c in contracts
        if c["type"] == "layers" and all(p.strip().count(".") == 1 for layer in c["layers"] for p in layer.split("|"))
    ]
    layers = [[p.strip().removeprefix("tandemrl.") for p in layer.split("|")] for layer in layers_contract["layers"]]
    forbidden: dict[str, set[str]] = {}
    for c in contracts:
        if c["type"] == "forbidden":
            for src in c["source_modules"]:
                names = {m.removeprefix("tandemrl.") for m in c["forbidden_modules"]}
                forbidden.setdefault(src.removeprefix("tandemrl."), set()).update(names)
    allowed: dict[str, set[str]] = {}
    for i, layer in enumerate(layers):
        below = {p for lower in layers[i + 1 :] for p in lower}
        for pkg in layer:
            allowed[pkg] = below - forbidden.get(pkg, set())
    return allowed


def test_every_package_has_a_row_and_every_row_a_package() -> None:
    rows = doc_table(DOC.read_text(encoding="utf-8"))
    missing = sorted(set(packages()) - set(rows))
    assert not missing, f"docs/architecture.md has no row for package(s) {missing}: say what each may import"
    gone = sorted(set(rows) - set(packages()))
    assert not gone, f"docs/architecture.md has rows for package(s) {gone} that tandemrl no longer has"


def test_every_package_is_in_the_layers_contract() -> None:
    assert set(packages()) <= set(allowed_imports()), "a package is missing from [tool.importlinter] layers"


def test_rows_say_what_the_contracts_allow() -> None:
    rows = doc_table(DOC.read_text(encoding="utf-8"))
    allowed = allowed_imports()
    for pkg in packages():
        assert rows.get(pkg) == allowed[pkg], (
            f"docs/architecture.md: `{pkg}` may import {sorted(allowed[pkg])} by pyproject.toml's contracts, "
            f"the page says {sorted(rows.get(pkg, set()))}"
        )


def test_every_nested_package_is_named() -> None:
    text = DOC.read_text(encoding="utf-8")
    for nested in nested_packages():
        assert f"`{nested}`" in text, f"docs/architecture.md never names the package `{nested}`"


def test_a_new_package_fails_the_check(tmp_path: Path) -> None:
    """The check is not vacuous: a package tree with one more package than the page lacks a row."""
    for name in [*packages(), "newroom"]:
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("", encoding="utf-8")
    rows = doc_table(DOC.read_text(encoding="utf-8"))
    assert sorted(set(packages(tmp_path)) - set(rows)) == ["newroom"]
