"""FreqControl schedules, and Saver/Evaluator firing and checkpoint paths."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from utils import free_port

from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.utils import EvaluatorConfig, SaverConfig
from tandemrl.trainers import freq
from tandemrl.trainers.evaluator import Evaluator
from tandemrl.trainers.freq import FreqControl
from tandemrl.trainers.saver import Saver, final_outputs_line


class FakeClock:
    """Stands in for the ``time`` module inside tandemrl.trainers.freq."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(freq, "time", fake)
    return fake


class RecordingEngine:
    """Collaborator double: remembers what it was asked to save."""

    def __init__(self) -> None:
        self.metas: list[SaveLoadMeta] = []

    def save(self, meta: SaveLoadMeta) -> None:
        self.metas.append(meta)


class RecordingTokenizer:
    def save_pretrained(self, path: str) -> None:
        Path(path, "tokenizer.json").write_text("{}")


# 3 steps per epoch, 2 epochs.
SPEC = FinetuneSpec(total_train_epochs=2, dataset_size=12, train_batch_size=4)


def _run(spec: FinetuneSpec):
    """(epoch, step-in-epoch, global_step) over the whole run."""
    g = 0
    for epoch in range(spec.total_train_epochs):
        for step in range(spec.steps_per_epoch):
            yield epoch, step, g
            g += 1


def test_freq_steps():
    ctl = FreqControl(freq_steps=2)
    assert [ctl.check(0, 1) for _ in range(6)] == [False, True, False, True, False, True]


def test_freq_epochs():
    ctl = FreqControl(freq_epochs=2)
    assert [ctl.check(e, 1) for e in [0, 1, 0, 1, 1]] == [False, False, False, True, False]


def test_freq_none_never_fires():
    ctl = FreqControl()
    assert not any(ctl.check(1, 1) for _ in range(10))


def test_freq_secs(clock: FakeClock):
    ctl = FreqControl(freq_secs=10)
    clock.now += 9.0
    assert not ctl.check(0, 1)
    clock.now += 1.0
    assert ctl.check(0, 1)
    clock.now += 5.0
    assert not ctl.check(0, 1)  # timer restarted at the last fire


def test_any_condition_fires_and_resets_all(clock: FakeClock):
    ctl = FreqControl(freq_steps=3, freq_secs=10)
    assert not ctl.check(0, 1)
    clock.now += 10.0
    assert ctl.check(0, 1)  # time fired; step counter restarts as well
    assert not ctl.check(0, 1)
    assert not ctl.check(0, 1)
    assert ctl.check(0, 1)


def test_state_dict_round_trip(clock: FakeClock):
    ctl = FreqControl(freq_steps=3, freq_secs=100)
    ctl.check(0, 1)
    ctl.check(0, 1)
    clock.now += 40.0
    state = ctl.state_dict()
    clock.now += 1000.0  # time spent while the run was down does not count
    resumed = FreqControl(freq_steps=3, freq_secs=100)
    resumed.load_state_dict(state)
    assert resumed.check(0, 1)  # third step since the last fire
    resumed2 = FreqControl(freq_secs=100)
    resumed2.load_state_dict({"epochs": 0, "steps": 0, "elapsed_secs": 95.0})
    assert not resumed2.check(0, 0)
    clock.now += 5.0
    assert resumed2.check(0, 0)


def test_freq_rejects_bad_values():
    with pytest.raises(ValueError, match="freq_steps"):
        FreqControl(freq_steps=0)
    with pytest.raises(ValueError, match="freq_secs"):
        FreqControl(freq_secs=-1)
    with pytest.raises(KeyError, match="elapsed_secs"):
        FreqControl().load_state_dict({"epochs": 0, "steps": 0})


def _saver_cfg(tmp_path: Path, **freqs) -> SaverConfig:
    return SaverConfig(experiment_name="exp", trial_name="t1", fileroot=str(tmp_path), **freqs)


def test_saver_every_two_steps_writes_hf_checkpoints(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path, freq_steps=2), SPEC)
    engine = RecordingEngine()
    fired = [saver.save(engine, e, s, g, tokenizer="/models/tok") for e, s, g in _run(SPEC)]
    assert fired == [False, True, False, True, False, True]
    expected = [
        tmp_path / "checkpoints/exp/t1/epoch0epochstep1globalstep1",
        tmp_path / "checkpoints/exp/t1/epoch1epochstep0globalstep3",
        tmp_path / "checkpoints/exp/t1/epoch1epochstep2globalstep5",
    ]
    # Each is written under <name>.tmp and renamed once complete.
    assert [m.path for m in engine.metas] == [f"{p}.tmp" for p in expected]
    assert all(m.weight_format == "hf" and m.tokenizer_path == "/models/tok" for m in engine.metas)
    assert all(p.is_dir() for p in expected) and not list(tmp_path.glob("checkpoints/exp/t1/*.tmp"))


def test_saver_every_epoch_fires_on_last_step_of_epoch(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path, freq_epochs=1), SPEC)
    engine = RecordingEngine()
    fired = [(g, saver.save(engine, e, s, g)) for e, s, g in _run(SPEC)]
    assert [g for g, f in fired if f] == [2, 5]


def test_saver_force_and_tokenizer_object(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path), SPEC)  # no frequency: only forced saves
    engine = RecordingEngine()
    assert not saver.save(engine, 0, 0, 0)
    assert saver.save(engine, 0, 1, 1, tokenizer=RecordingTokenizer(), force=True)
    assert len(engine.metas) == 1 and engine.metas[0].tokenizer_path is None
    assert Path(tmp_path, "checkpoints/exp/t1/epoch0epochstep1globalstep1/tokenizer.json").exists()
    assert Saver.get_save_path("/r", "e", "t", 1, 2, 3) == "/r/checkpoints/e/t/epoch1epochstep2globalstep3"


def test_saver_saves_the_last_step_whatever_the_frequency(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path, freq_steps=4), SPEC)
    engine = RecordingEngine()
    steps = list(_run(SPEC))
    fired = [saver.save(engine, e, s, g, last=g == len(steps) - 1) for e, s, g in steps]
    assert fired == [False, False, False, True, False, True]  # step 4 by frequency, step 6 as the last
    assert saver.last_path == str(tmp_path / "checkpoints/exp/t1/epoch1epochstep2globalstep5")
    assert "final model (HF format, loadable by transformers and vLLM): " + saver.last_path in final_outputs_line(
        "grpo", saver.last_path
    )
    off = Saver(_saver_cfg(tmp_path / "off", save_final=False), SPEC)  # no frequency, no final save
    assert [off.save(engine, e, s, g, last=g == len(steps) - 1) for e, s, g in steps][-1] is False
    assert off.last_path is None and "no model saved" in final_outputs_line("grpo", off.last_path)


class FailingEngine(RecordingEngine):
    """Writes one file into the checkpoint, like an engine whose disk then fails."""

    def save(self, meta: SaveLoadMeta) -> None:
        super().save(meta)
        Path(meta.path, "model.safetensors").write_bytes(b"w")


def test_unwritable_checkpoint_dir_is_one_line_naming_it(tmp_path: Path):
    """A fileroot whose checkpoints dir cannot be created (its parent is a regular file, which
    stops root too, unlike chmod): one line naming the path; nothing half-written."""
    from tandemrl.trainers.saver import CheckpointWriteError

    (tmp_path / "checkpoints").write_text("not a directory")
    saver = Saver(_saver_cfg(tmp_path), SPEC)
    with pytest.raises(CheckpointWriteError) as e:
        saver.save(FailingEngine(), 0, 1, 1, force=True)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError)  # run_main prints it as one error line
    assert msg == (
        f"saver: cannot write checkpoint to {tmp_path}/checkpoints/exp/t1/epoch0epochstep1globalstep1.tmp: "
        "Not a directory (ENOTDIR)"
    )


def test_saver_force_restarts_step_counter(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path, freq_steps=2), SPEC)
    engine = RecordingEngine()
    assert saver.save(engine, 0, 0, 0, force=True)
    assert not saver.save(engine, 0, 1, 1)
    assert saver.save(engine, 0, 2, 2)


def test_saver_needs_spec_for_epochs(tmp_path: Path):
    with pytest.raises(ValueError, match="freq_epochs"):
        Saver(_saver_cfg(tmp_path, freq_epochs=1), None)


def test_saver_state_dict(tmp_path: Path):
    saver = Saver(_saver_cfg(tmp_path, freq_steps=3), SPEC)
    engine = RecordingEngine()
    saver.save(engine, 0, 0, 0)
    saver.save(engine, 0, 1, 1)
    resumed = Saver(_saver_cfg(tmp_path, freq_steps=3), SPEC)
    resumed.load_state_dict(saver.state_dict())
    assert resumed.save(engine, 0, 2, 2)


def test_evaluator_runs_callable_when_due(tmp_path: Path, clock: FakeClock):
    cfg = EvaluatorConfig(experiment_name="exp", trial_name="t1", fileroot=str(tmp_path), freq_steps=4, freq_secs=60)
    evaluator = Evaluator(cfg, SPEC)
    calls: list[int] = []
    ran = []
    for e, s, g in _run(SPEC):
        if g == 1:
            clock.now += 61.0
        ran.append(evaluator.evaluate(lambda g=g: calls.append(g), e, s, g))
    assert ran == [False, True, False, False, False, True]
    assert calls == [1, 5]


def test_evaluator_epochs(tmp_path: Path):
    cfg = EvaluatorConfig(experiment_name="exp", trial_name="t1", fileroot=str(tmp_path), freq_epochs=2)
    evaluator = Evaluator(cfg, SPEC)
    calls: list[int] = []
    for e, s, g in _run(SPEC):
        evaluator.evaluate(lambda g=g: calls.append(g), e, s, g)
    assert calls == [5]


# ------------------------------------------------ 2 ranks: wall-time decisions agree
def _secs_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fake = FakeClock()
        freq.time = fake  # this child process only
        saver = Saver(SaverConfig(experiment_name="e", trial_name="t", fileroot=out_dir, freq_secs=10), SPEC)
        engine = RecordingEngine()
        results = []
        fake.now += 100.0 if rank == 0 else 0.0  # only rank 0's clock says "due"
        results.append(saver.save(engine, 0, 0, 0))
        fake.now += 100.0 if rank == 1 else 0.0  # only rank 1's clock says "due"
        results.append(saver.save(engine, 0, 1, 1))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"fired": results, "saves": len(engine.metas)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_wall_time_saves_follow_rank0(tmp_path: Path):
    mp.spawn(_secs_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"fired": [True, False], "saves": 1}
