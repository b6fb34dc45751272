"""Checkpoint manifests and the fallback to the previous recoverable checkpoint (issue 33 item 3), on
hand-made checkpoint directories: each damage is named by its file in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_recover import _handler

from tandemrl.trainers.manifest import ManifestMismatch, check_manifest, write_manifest
from tandemrl.trainers.recover import LOOP_STATE_FILE, CorruptCheckpointError
from tandemrl.trainers.saver import CheckpointWriteError, writing_checkpoint


def _checkpoint(root: Path, step: int) -> Path:
    (root / "engines" / "actor").mkdir(parents=True)
    (root / "engines" / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (root / "engines" / "actor" / ".metadata").write_bytes(b"meta" * 10)
    (root / LOOP_STATE_FILE).write_text(json.dumps({"global_step": step}))
    write_manifest(str(root))
    return root


def test_a_truncated_changed_or_missing_file_is_named(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "c", 1)
    check_manifest(str(ckpt))  # as written: passes
    shard = ckpt / "engines" / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ManifestMismatch, match=f"^{shard}: 1000 bytes, 16384 were written$"):
        check_manifest(str(ckpt))
    ckpt = _checkpoint(tmp_path / "d", 1)
    meta = ckpt / "engines" / "actor" / ".metadata"
    meta.write_bytes(b"META" * 10)  # same size, other bytes
    with pytest.raises(ManifestMismatch, match=f"^{meta}: contents differ from what was written$"):
        check_manifest(str(ckpt))
    meta.unlink()
    with pytest.raises(ManifestMismatch, match=f"^{meta}: missing$"):
        check_manifest(str(ckpt))
    os.remove(ckpt / "manifest.json")
    check_manifest(str(ckpt))  # written before manifests existed: not checked


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handler = _handler(tmp_path, "auto")
    newest, previous = Path(handler.path), Path(handler.path + ".prev")
    _checkpoint(newest, 2)
    _checkpoint(previous, 1)
    assert handler.find() == str(newest)
    shard = newest / "engines" / "actor" / "__0_0.distcp"
    shard.write_bytes(b"")
    assert handler.find() == str(previous)
    line = capsys.readouterr().out.strip()
    assert line == (
        f"recover: checkpoint {newest} is corrupt: {shard}: 0 bytes, 16384 were written; "
        f"resuming from the previous one, {previous}"
    )
    (previous / LOOP_STATE_FILE).write_text("{}")  # both damaged: one line, no resume
    with pytest.raises(CorruptCheckpointError) as err:
        handler.load()
    assert str(err.value) == (
        f"recover: checkpoint {previous} is corrupt: {previous / LOOP_STATE_FILE}: 2 bytes, 18 were written"
    )


class CheckpointFailure(BaseException):
    """Shaped like torch's CheckpointException: a BaseException holding each rank's (error, traceback)."""

    def __init__(self) -> None:
        super().__init__("CheckpointException ranks:dict_keys([0])\nTraceback: ...")
        self.failures = {0: (OSError(5, "Input/output error"), "traceback lines")}


def test_a_checkpoint_exception_is_one_line_naming_the_path_and_its_cause(tmp_path: Path) -> None:
    with pytest.raises(CheckpointWriteError) as err, writing_checkpoint(str(tmp_path), "recover"):
        raise CheckpointFailure()
    assert str(err.value) == f"recover: writing checkpoint {tmp_path} failed: OSError: [Errno 5] Input/output error"
    with pytest.raises(KeyboardInterrupt), writing_checkpoint(str(tmp_path), "recover"):
        raise KeyboardInterrupt  # never turned into a checkpoint error


def test_a_finished_run_is_found_only_under_the_same_length(tmp_path) -> None:
    """configs.utils.finished_run, what a launcher reads before starting anything: the recoverable checkpoint's
    loop state marked finished, under the same total_train_steps/_epochs; anything else is left to the trainer."""
    import json

    from tandemrl.configs.utils import finished_run, save_root

    length = {"total_train_steps": 2, "total_train_epochs": 1}
    recover = tmp_path / "checkpoints" / "exp" / "t0" / "recover"
    assert save_root(str(tmp_path), "exp", "t0") == str(recover.parent)
    assert finished_run(str(tmp_path), "exp", "t0", length) is None  # no checkpoint
    recover.mkdir(parents=True)
    state = {"global_step": 1, "finished": True, "final_model": "/m", "length": length}
    (recover / LOOP_STATE_FILE).write_text(json.dumps(state))
    assert finished_run(str(tmp_path), "exp", "t0", length) == state
    assert finished_run(str(tmp_path), "exp", "t0", {**length, "total_train_steps": 4}) is None  # made longer
    (recover / LOOP_STATE_FILE).write_text(json.dumps({**state, "finished": False}))
    assert finished_run(str(tmp_path), "exp", "t0", length) is None
    (recover / LOOP_STATE_FILE).write_text("{not json")
    assert finished_run(str(tmp_path), "exp", "t0", length) is None
