"""build_once: the model cache's build-then-rename, and what a crashed build leaves behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandemrl.models.cache import build_once, cache_root


def _write(tmp: Path) -> None:
    (tmp / "config.json").write_text("{}")


def test_temp_dirs_of_a_killed_builder_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".m.tmp-dead"
    (stale / "half").mkdir(parents=True)
    other = tmp_path / ".other.tmp-live"  # another model's build: not ours to remove
    other.mkdir()
    built = build_once(tmp_path / "m", _write)
    assert Path(built, "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-live", "m"]


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path: Path) -> None:
    def boom(tmp: Path) -> None:
        _write(tmp)
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        build_once(tmp_path / "m", boom)
    assert list(tmp_path.iterdir()) == []
    calls: list[Path] = []
    assert build_once(tmp_path / "m", lambda tmp: calls.append(tmp)) == str(tmp_path / "m")
    assert build_once(tmp_path / "m", lambda tmp: calls.append(tmp)) == str(tmp_path / "m")
    assert len(calls) == 1


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEMRL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("TANDEMRL_CACHE")
    assert cache_root() == Path("~/.cache/tandemrl").expanduser()
