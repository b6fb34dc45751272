"""The machine line every benchmark prints before and after its run (tandemrl/utils/machine.py)."""

from __future__ import annotations

import datetime
import os

import pytest

from tandemrl.utils.machine import cpu_model, machine_line, measured_on


def test_machine_line_names_time_cpu_cores_and_load() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)
    line = machine_line(when)
    assert line.startswith("2026-01-02 03:04 UTC, ")
    assert cpu_model() in line
    assert f"of {os.cpu_count()} cores" in line
    load = line.rsplit("load average ", 1)[1].split("/")
    assert len(load) == 3 and all(float(x) >= 0 for x in load)


def test_measured_on_prints_start_and_end_even_when_the_run_fails(capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError), measured_on("bench-x"):
        print("working")
        raise RuntimeError("boom")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["[bench-x] start", "working", "[bench-x] end"]


def test_measured_on_is_silent_on_other_ranks(capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with measured_on("bench-x"):
        pass
    assert capsys.readouterr().out == ""
