"""A full disk during a run is named in one line: the pieces between a rank's error and the launcher's summary.

On a full disk a rank's torchrun error file could not be written whole: torchrun then stopped on a
JSONDecodeError traceback reading it, and the launcher, finding no error file, said only "trainer exited
with 1". The rank removes a half-written error file, torchrun's wrapper turns whatever else it stops on into
one line, and the launcher's summary falls back to the first ``error:`` line the trainer printed.
(tests/e2e/test_faults_runtime.py runs a launched job into a full tmpfs.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandemrl.api.inference import ModelResponse
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.configs.utils import StatsLoggerConfig, TensorBoardConfig
from tandemrl.launchers.common import pump, trainer_failure
from tandemrl.launchers.torchrun_loopback import run_quietly
from tandemrl.trainers.prompt_log import log_prompt_ids
from tandemrl.trainers.stats_logger import StatsLogger
from tandemrl.trainers.turns import TurnTaker
from tandemrl.utils import cli
from tandemrl.utils.cli import TRAINER_LOG_ENV, record_error
from tandemrl.workflows.rlvr import RLVRWorkflow

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounting the full tmpfs needs root")


@contextlib.contextmanager
def full_tmpfs(disk: Path) -> Iterator[Path]:
    """An 8 KiB tmpfs at ``disk``, filled: the next write on it fails with ENOSPC."""
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(disk)], check=True)
    try:
        with open(disk / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 512)
            except OSError:
                pass
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@ROOT_ONLY
def test_a_rank_leaves_no_half_written_error_file_on_a_full_disk(tmp_path: Path, monkeypatch) -> None:
    with full_tmpfs(tmp_path / "disk") as disk:
        error_file = disk / "error.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        record_error(RuntimeError("cannot write checkpoint: No space left on device (ENOSPC)"))
        assert not error_file.exists()  # before: an empty error.json that torchrun could not parse
        (disk / "filler").unlink()
        record_error(RuntimeError("the cause"))  # with room it is written as torchrun reads it
        assert json.loads(error_file.read_text())["message"]["message"].startswith("RuntimeError: the cause")


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


# ------------------------------------------------------------------ a full disk under the run's own files


def _rank_fails(main: Callable[[], object], root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``main`` as a launched rank's entry point (``run_main`` with the trainer.log and the torchrun error
    file the local launcher sets); it must exit 1."""
    error_file = root / "torchrun" / "run" / "attempt_0" / "0" / "error.json"  # where first_rank_error looks
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv(TRAINER_LOG_ENV, str(root / "trainer.log"))
    monkeypatch.delenv("TANDEMRL_TRACEBACK", raising=False)
    monkeypatch.setattr(cli, "quiet_process", lambda: None)  # it sets this process's environment for good
    with pytest.raises(SystemExit) as exit_:
        cli.run_main(lambda argv: main(), [])
    assert exit_.value.code == 1


def _stats_jsonl(root: Path) -> None:
    config = StatsLoggerConfig(experiment_name="exp", trial_name="t", fileroot=str(root), console=False, plot=False)
    StatsLogger(config).commit(0, 0, 0, {"loss": 1.0})


class _Client:
    def sleep(self, level: int) -> None:
        pass

    def wake_up(self) -> None:
        pass


def _turns_jsonl(root: Path) -> None:
    with TurnTaker(_Client(), colocated=True, log_dir=str(root / "logs"), sleep_level=0).trainer_turn():
        pass


class _Text:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "#### 4"


def _rollout_dump(root: Path) -> None:
    wf = RLVRWorkflow(lambda **kw: 1.0, GenerationHyperparameters(), _Text(), dump_dir=str(root / "dump"))
    try:
        wf.dump("2 + 2", [ModelResponse(input_tokens=[1], output_tokens=[2], output_versions=[0])], [1.0])
    finally:
        wf.reward.shutdown()


# What a rank appends to as it trains; a write on the open file raises an OSError without a file name.
RUN_FILES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "stats.jsonl": ("logs/exp/t/stats.jsonl", _stats_jsonl),
    "prompt_ids.jsonl": ("logs/prompt_ids.jsonl", lambda root: log_prompt_ids(str(root / "logs"), 0, [{"id": 1}], [])),
    "turns.jsonl": ("logs/turns.jsonl", _turns_jsonl),
    "rollout dump": ("dump/0.jsonl", _rollout_dump),
}


@pytest.mark.parametrize("name", list(RUN_FILES))
def test_a_full_disk_under_a_file_the_run_appends_to_is_one_line_naming_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file is /dev/full (every write fails with ENOSPC, at the flush when the file is closed): the rank's
    one line names the file and the errno, no traceback; the error file the launcher reads names the file too."""
    relative, write = RUN_FILES[name]
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/full")
    _rank_fails(lambda: write(tmp_path), tmp_path, monkeypatch)
    err = capsys.readouterr().err
    log = tmp_path / "trainer.log"
    assert err == f"error: OSError: {path}: No space left on device (ENOSPC) (traceback in {log})\n", err
    summary = trainer_failure(tmp_path, 1, 0)
    assert summary == f"trainer rank 0: OSError: [Errno 28] No space left on device: '{path}'", summary


@ROOT_ONLY
def test_a_full_disk_under_tensorboard_is_one_line_naming_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TensorBoard's event file on a full tmpfs: its writer thread fails, the rank's one line names the directory
    and the errno, and the thread prints no traceback of its own."""
    seen: list[BaseException | None] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)  # what would print "Exception in thread"
    try:
        with full_tmpfs(tmp_path / "disk") as disk:
            tb = disk / "tb"
            config = StatsLoggerConfig(
                experiment_name="exp", trial_name="t", fileroot=str(tmp_path), console=False, jsonl=False,
                tensorboard=TensorBoardConfig(path=str(tb)),
            )  # fmt: skip
            _rank_fails(lambda: StatsLogger(config), tmp_path, monkeypatch)
            writers = [t for t in threading.enumerate() if type(t).__module__.startswith("tensorboard.")]
            for t in writers:  # ended: its exception went through the hook, or never will
                t.join(timeout=30)
            assert not any(t.is_alive() for t in writers)
    finally:
        threading.excepthook = previous
    assert seen == []
    err = capsys.readouterr().err
    assert err == f"error: OSError: {tb}: No space left on device (ENOSPC) (traceback in {tmp_path}/trainer.log)\n"
