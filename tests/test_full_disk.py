"""A full disk during a run is named in one line: the pieces between a rank's error and the launcher's summary.

On a full disk a rank's torchrun error file could not be written whole: torchrun then stopped on a
JSONDecodeError traceback reading it, and the launcher, finding no error file, said only "trainer exited
with 1". The rank removes a half-written error file, torchrun's wrapper turns whatever else it stops on into
one line, and the launcher's summary falls back to the first ``error:`` line the trainer printed.
(tests/test_faults_runtime.py runs a launched job into a full tmpfs.)
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from tandemrl.launchers.common import pump, trainer_failure
from tandemrl.launchers.torchrun_loopback import run_quietly
from tandemrl.utils.cli import record_error


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the full tmpfs needs root")
def test_a_rank_leaves_no_half_written_error_file_on_a_full_disk(tmp_path: Path, monkeypatch) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(disk)], check=True)
    try:
        with open(disk / "filler", "wb", buffering=0) as f:  # fill it: the next write fails with ENOSPC
            try:
                while True:
                    f.write(b"x" * 512)
            except OSError:
                pass
        error_file = disk / "error.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        record_error(RuntimeError("cannot write checkpoint: No space left on device (ENOSPC)"))
        assert not error_file.exists()  # before: an empty error.json that torchrun could not parse
        (disk / "filler").unlink()
        record_error(RuntimeError("the cause"))  # with room it is written as torchrun reads it
        assert json.loads(error_file.read_text())["message"]["message"].startswith("RuntimeError: the cause")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_torchrun_stopping_on_an_unreadable_error_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def torchrun_main() -> None:
        json.loads("")  # what torchrun raised reading an empty error.json

    assert run_quietly(torchrun_main) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: torchrun stopped on JSONDecodeError: Expecting value") and err.count("\n") == 1


def test_the_summary_names_what_the_trainer_printed_when_no_error_file_exists(tmp_path: Path) -> None:
    out = b"[rank] loading\nerror: CheckpointWriteError: cannot write checkpoint to /r/recover.tmp: No space left on device (ENOSPC)\n"
    t = pump(io.BytesIO(out + b"error: a second one\n"), "trainer", tmp_path / "trainer.log")
    t.join(timeout=30)
    assert (
        t.first_error
        == "CheckpointWriteError: cannot write checkpoint to /r/recover.tmp: No space left on device (ENOSPC)"
    )
    assert trainer_failure(tmp_path, 1, 0, t.first_error) == f"trainer: {t.first_error}"
    assert trainer_failure(tmp_path, 1, 0) == "trainer exited with 1"
    assert (tmp_path / "trainer.log").read_bytes().startswith(out)  # the log still gets every line
