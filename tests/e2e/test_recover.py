"""Auto-resume of RL runs (``recover.mode``): a real 3-step GRPO run through the launcher whose trainer
is SIGKILLed in step 3, then the same command resumes at step 3 on the restored weights, trains the
prompts that were in flight at the checkpoint, none skipped or repeated, and its sample ledger explains
every generated sample across the kill; plus the one-line errors for a missing or corrupt checkpoint and
the staleness/dataloader/executor pieces resuming relies on.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_executor import RandomDelayEngine, ToyWorkflow
from utils import LAUNCH_ENV, REPO_ROOT, is_torchrun
from vllm_server import RunningServer

from tandemrl.api.types import SaveLoadMeta
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.configs.utils import RecoverConfig
from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
from tandemrl.data.loader import collate_as_list, create_dataloader, cycle_batches, dataset_from_config
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.rollout.staleness import StalenessManager
from tandemrl.trainers.manifest import check_manifest
from tandemrl.trainers.prompt_log import read_prompt_log
from tandemrl.trainers.recover import (
    LOOP_STATE_FILE,
    CorruptCheckpointError,
    RecoverHandler,
    RecoverStates,
    weights_fingerprint,
)

LAUNCH = [sys.executable, "-m", "tandemrl.launchers.local"]
ENV = LAUNCH_ENV


def _step_scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """step -> value of ``tag`` over every event file in ``tb_dir`` (both runs write there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


STEPS, PROMPTS, GROUP = 3, 8, 4  # steps of the run, prompts per step, samples per prompt
# 40 stop tokens of the tiny model's 1024 (its untrained outputs are near uniform): about 4 in 10 of the
# 24-token samples run to the length limit, the others end with a stop token.
STOP_IDS = [2, *range(100, 140)]


def _grpo_args(tiny_model_dir: str, gsm8k_dir: str, root: Path) -> list[str]:
    """tests/workers/grpo_ledger.py: its reward fails on some prompts (group dropped) and is uniform on
    others (dynamic sampling filters them); ``mask_no_eos`` leaves the truncated samples out of the loss."""
    stop = ",".join(map(str, STOP_IDS))
    return [
        "tests/workers/grpo_ledger.py",
        "--config",
        "examples/gsm8k_grpo.yaml",
        f"actor.engine.path={tiny_model_dir}",
        f"train_dataset.path={gsm8k_dir}",
        f"cluster.fileroot={root}",
        f"total_train_steps={STEPS}",
        "recover.mode=auto",
        "recover.freq_steps=2",
        "saver.freq_steps=2",
        "evaluator.freq_steps=100",
        "valid_dataset.max_samples=4",
        "gconfig.max_new_tokens=24",
        f"gconfig.stop_token_ids=[{stop}]",
        f"actor.eos_token_ids=[{stop}]",
        "actor.dynamic_sampling=true",
        "actor.mask_no_eos=true",
        "stats_logger.wandb.mode=disabled",
        # Decoupled weight decay moves every weight whatever the advantages, so "training changed them" holds.
        "actor.engine.optimizer.weight_decay=0.1",
        "stats_logger.prompt_ids=true",
    ]


def _trainable(prompt_id: int) -> bool:
    """Prompts the worker's reward neither fails on nor gives a uniform reward (both never trained)."""
    return prompt_id % 5 not in (0, 1)


def _balance(stats: dict[str, float], unit: str) -> tuple[float, float]:
    """(generated, consumed + every discard + in flight) of a stats line, in ``unit``."""
    out = sum(v for k, v in stats.items() if k.startswith("ledger/discarded/") and k.endswith(f"_{unit}"))
    return stats[f"ledger/generated_{unit}"], out + stats[f"ledger/consumed_{unit}"] + stats[f"ledger/in_flight_{unit}"]


def _kill_trainer_after_step(proc: subprocess.Popen[str], prompt_log: Path, global_step: int) -> None:
    """SIGKILL the trainer rank once it has logged ``global_step`` (after that step's checkpoint); the
    launcher then fails the trial and stops the servers."""
    import psutil

    deadline = time.monotonic() + 900
    while not any(line["global_step"] == global_step for line in _read_lines(prompt_log)):
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before step {global_step + 1}"
        assert time.monotonic() < deadline, f"no step {global_step + 1} in 900 s"
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_rank(p)]
    assert ranks, "no trainer rank to kill"
    for rank in ranks:
        rank.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=300) != 0


def _is_rank(p: Any) -> bool:
    import psutil

    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "grpo_ledger.py" in cmd and not is_torchrun(cmd)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.slow
def test_grpo_killed_mid_run_resumes_and_the_ledger_explains_every_sample(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """A 3-step GRPO run SIGKILLed in step 3, after step 2's recoverable checkpoint; the same command
    resumes at step 3 on the restored weights. Every logged step's sample ledger balances in samples and
    tokens, counts the dropped, filtered and too-long samples it was built to produce, and each step hands
    the trainer one batch (8 prompts x 4 samples); the samples in flight at the checkpoint come back as
    ``lost_at_restart`` and their prompts are trained after the resume, none skipped, none twice. Both launches
    use the session's server (``running_server``), which outlives the killed run as a user's running server does."""
    from transformers import AutoModelForCausalLM

    log_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    tb = tmp_path / "tensorboard" / "gsm8k-grpo" / "trial0"
    args = _grpo_args(tiny_model_dir, gsm8k_dir, tmp_path) + running_server.overrides
    env = {**ENV, **running_server.env}
    proc = subprocess.Popen(
        LAUNCH + args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        _kill_trainer_after_step(proc, log_dir / "prompt_ids.jsonl", 1)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(60)
    assert not reader.is_alive(), "the launcher's output did not end"  # else the line below reads a part of it
    assert "grpo done" not in "".join(out), "".join(out)[-3000:]
    first_log = (log_dir / "trainer.log").read_text()
    saved = re.findall(r"recover: saved global step (\d+) \(version (\d+), weights (\w+)\)", first_log)
    assert [(s, v) for s, v, _ in saved] == [("2", "2")], saved
    fingerprint = saved[0][2]
    recover_dir = tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0" / "recover"
    assert (recover_dir / LOOP_STATE_FILE).is_file() and not (recover_dir.parent / "recover.tmp").exists()
    lost = json.loads((recover_dir / "ledger_rank0.json").read_text())["in_flight"]  # [samples, tokens]
    # The recover checkpoint holds exactly the weights the saver exported after step 2.
    export = tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0" / "epoch0epochstep1globalstep1"
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert weights_fingerprint(exported.state_dict().items()) == fingerprint
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert weights_fingerprint(original.state_dict().items()) != fingerprint  # training changed them
    killed_stats = _read_lines(log_dir / "stats.jsonl")

    second = subprocess.run(LAUNCH + args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    text = (log_dir / "trainer.log").read_text()[len(first_log) :]  # the launcher appends: the resumed run only
    resumed = re.findall(r"recover: resumed from \S+ after global step (\d+) \(version (\d+), weights (\w+)\)", text)
    # The engine starts on the saved weights (re-fingerprinted after loading), at version 2.
    assert resumed == [("2", "2", fingerprint)], text[-3000:]
    assert "grpo done: 1 steps" in text, text[-3000:]
    # Steps 1-2 come from the first run, step 3 (index 2) from the second.
    losses = _step_scalars(tb, "actor/ppo_actor/update/loss")
    assert sorted(losses) == [0, 1, 2], losses
    # Step 3's rollouts were sampled by the servers at the restored version 2 (pushed before the rollout).
    versions = _step_scalars(tb, "rollout_version_min")
    assert versions[2] == 2 and _step_scalars(tb, "rollout_version_max")[2] == 2, versions
    _check_ledger(killed_stats, _read_lines(log_dir / "stats.jsonl")[len(killed_stats) :], lost, text)
    _check_prompts(tiny_model_dir, gsm8k_dir, log_dir)


def _check_ledger(killed: list[dict[str, Any]], resumed: list[dict[str, Any]], lost: list[int], text: str) -> None:
    """Both runs' stats lines balance and hand the trainer one batch a step (counted from the run's start, the
    restored ledger included); the resumed run's ``lost_at_restart`` is what the checkpoint had in flight."""
    by_step = {line["step"]: line for line in killed if line["step"] <= 2}  # the resumed run redoes step 3
    by_step.update({line["step"]: line for line in resumed})
    assert sorted(by_step) == [1, 2, 3], sorted(by_step)
    for step, stats in by_step.items():
        for unit in ("samples", "tokens"):
            gen, out = _balance(stats, unit)
            assert gen == out and gen > 0, (step, unit, gen, out)
        handed = stats["ledger/consumed_samples"] + stats["ledger/discarded/too_long_samples"]
        assert handed == step * PROMPTS * GROUP, (step, handed)
        expected_lost = lost if step == 3 else [0, 0]
        got = [stats["ledger/discarded/lost_at_restart_samples"], stats["ledger/discarded/lost_at_restart_tokens"]]
        assert got == expected_lost, (step, got)
    last = by_step[3]
    for reason in ("group_dropped", "filtered", "too_long"):  # what the worker's reward and mask_no_eos produce
        n = last[f"ledger/discarded/{reason}_samples"]
        assert n > 0 and last[f"ledger/discarded/{reason}_tokens"] > 0, (reason, n)
        assert reason == "too_long" or n % GROUP == 0, (reason, n)  # whole groups
    assert last["ledger/consumed_samples"] > 0
    # The closing line reports the run's totals: they balance, and name what was lost at the restart.
    m = re.search(
        r"grpo ledger: generated (\d+) .* = consumed (\d+) .* \+ discarded (\d+) .* \+ in flight (\d+) ", text
    )
    assert m is not None, text[-3000:]
    gen, consumed, discarded, in_flight = map(int, m.groups())
    assert gen == consumed + discarded + in_flight and gen >= last["ledger/generated_samples"], m.group(0)
    assert lost[0] == 0 or f"lost_at_restart {lost[0]} ({lost[1]} tokens)" in m.group(0), m.group(0)


def _check_prompts(tiny_model_dir: str, gsm8k_dir: str, log_dir: Path) -> None:
    """The rows in flight at the kill (pending after step 2) are neither skipped nor trained twice; no
    prompt the reward fails on or scores uniformly is trained."""
    lines = {line["global_step"]: line for line in read_prompt_log(str(log_dir))}  # the resumed run's step 3 wins
    assert sorted(lines) == [0, 1, 2] and all(len(x["trained"]) == PROMPTS for x in lines.values())
    order = [i for i in _grpo_loader_order(tiny_model_dir, gsm8k_dir, 400) if _trainable(i)]
    trained = [i for step in (0, 1, 2) for i in lines[step]["trained"]]
    assert all(_trainable(i) for i in trained), trained
    _taken_prefix(order, trained[:16], [i for i in lines[1]["pending"] if _trainable(i)])
    _taken_prefix(order, trained, [i for i in lines[2]["pending"] if _trainable(i)])


def _grpo_loader_order(tiny_model_dir: str, gsm8k_dir: str, n: int) -> list[int]:
    """The first ``n`` prompt ids of the run's dataloader, built as RLTrainer builds it from the yaml's settings."""
    from tandemrl.models.hf import load_hf_tokenizer, model_context_length

    cfg = DatasetConfig(
        path=gsm8k_dir, type="rl", split="train", batch_size=8, shuffle=True, drop_last=True, max_length=256
    )
    tok = load_hf_tokenizer(tiny_model_dir)
    ds = dataset_from_config(cfg, tok, 0, 1, model_context_length(tiny_model_dir))
    batches = cycle_batches(create_dataloader(ds, cfg, 0, 1, seed=1))
    return [row["id"] for _ in range(n // 8) for row in next(batches)]


# ------------------------------------------------------------------------------ fast checks


def _handler(tmp_path: Path, mode: str, states: RecoverStates | None = None) -> RecoverHandler:
    cfg = RecoverConfig(mode=mode, freq_steps=1, experiment_name="e", trial_name="t", fileroot=str(tmp_path))
    return RecoverHandler(cfg, None, states or RecoverStates({}, None, None, None, None))


def test_recover_modes_and_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="recover.mode must be one of disabled, auto, resume; got 'always'"):
        _handler(tmp_path, "always")
    assert _handler(tmp_path, "auto").load() is None  # nothing yet: start fresh
    assert _handler(tmp_path, "disabled").load() is None
    with pytest.raises(FileNotFoundError) as exc:
        _handler(tmp_path, "resume").load()
    msg = str(exc.value)
    assert "\n" not in msg and "recover.mode=resume: no recoverable checkpoint at" in msg
    assert str(tmp_path / "checkpoints" / "e" / "t" / "recover") in msg


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "No such file"), ("{not json", "JSONDecodeError"), (json.dumps({"global_step": 1}), "lacks")],
)
def test_corrupt_checkpoint_is_a_one_line_error(tmp_path: Path, content: str | None, needle: str) -> None:
    handler = _handler(tmp_path, "auto")
    os.makedirs(handler.path)
    if content is not None:
        Path(handler.path, LOOP_STATE_FILE).write_text(content)
    with pytest.raises(CorruptCheckpointError) as exc:  # a ValueError: run_main prints it as one line
        handler.load()
    msg = str(exc.value)
    assert "\n" not in msg and f"recover: checkpoint {handler.path} is corrupt" in msg and needle in msg, msg


def test_weights_fingerprint_is_exact_and_order_free() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    fp = weights_fingerprint([("a", a), ("b", b)])
    assert fp == weights_fingerprint([("b", b.clone()), ("a", a.clone())])
    a2 = a.clone()
    a2[1, 2] += 1e-6
    assert fp != weights_fingerprint([("a", a2), ("b", b)])
    assert fp != weights_fingerprint([("a", a), ("c", b)])


def test_staleness_capacity_counts_from_the_resumed_version() -> None:
    fresh, resumed = StalenessManager(100, 4, 1), StalenessManager(100, 4, 1)
    resumed.set_base_version(5)
    # At version 5 a resumed run may run ahead as far as a fresh run at version 0, not 5 versions more.
    assert resumed.get_capacity(5) == fresh.get_capacity(0) == 8
    assert resumed.get_capacity(6) == fresh.get_capacity(1) == 12
    with pytest.raises(ValueError, match="version must be an integer >= 0"):
        resumed.set_base_version(-1)


def test_cycle_batches_survives_a_loader_restored_at_an_epoch_end() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(list(range(6)), batch_size=2, collate_fn=list)

    done = loader()
    it = iter(done)
    assert [next(it) for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]  # saved after the last batch of the epoch
    restored = loader()
    restored.load_state_dict(done.state_dict())
    assert list(restored) == []  # the restored epoch has nothing left ...
    batches = cycle_batches(restored)
    assert [next(batches) for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]  # ... the next pass starts
    with pytest.raises(ValueError, match="rollout_batch: the dataloader yielded no batches"):
        next(cycle_batches([], "rollout_batch"))


# ------------------------------------------------------------------ rows in flight at a checkpoint

BSZ = 4


def _loader_order(ds: Any, n: int) -> list[int]:
    """The ids of the first ``n`` rows an uninterrupted loader yields (epochs chained)."""
    batches = cycle_batches(create_dataloader(ds, DatasetConfig(batch_size=BSZ, shuffle=True), 0, 1, seed=2))
    return [row["id"] for _ in range(n // BSZ) for row in next(batches)]


def _executor(k: int, version: int = 0) -> tuple[WorkflowExecutor, RandomDelayEngine]:
    """An executor as a trainer resumed at ``version`` has it (servers at that version, capacity from it)."""
    engine = RandomDelayEngine(seed=k)
    engine.set_version(version)
    ex = WorkflowExecutor(InferenceClientConfig(max_head_offpolicyness=k), engine, consumer_batch_size=BSZ)
    ex.staleness.set_base_version(version)
    ex.initialize()
    return ex, engine


def _steps(ex: WorkflowExecutor, engine: RandomDelayEngine, loader: Any, n: int) -> list[list[int]]:
    """``n`` trainer steps: a batch, then the weight update; the sorted ids of each step's rows."""
    trained = []
    for _ in range(n):
        ex.prepare_batch(loader, ToyWorkflow(), timeout=60)
        trained.append(sorted(row["id"] for row in ex.last_batch_rows))
        ex.set_version(engine.get_version() + 1)
    return trained


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir: str) -> Any:
    return get_gsm8k_rl_dataset(gsm8k_dir, "test", None, 0, 1, max_samples=48)


def test_rows_in_flight_at_a_checkpoint_are_trained_first_after_resume(gsm8k_rows: Any) -> None:
    """Synchronous staleness (k=0) makes the schedule exact: step i trains loader batch i, kill or not."""
    order = _loader_order(gsm8k_rows, 4 * BSZ)
    batch = [sorted(order[i : i + BSZ]) for i in range(0, len(order), BSZ)]
    cfg = DatasetConfig(batch_size=BSZ, shuffle=True)
    ex, engine = _executor(k=0)
    gates = {pid: threading.Event() for pid in order[:BSZ]}
    engine.gates.update(gates)
    pulls = itertools.count()

    def collate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if next(pulls) == 1:  # batch 0 finishes only once batch 1 is taken from the loader
            for gate in gates.values():
                gate.set()
        return collate_as_list(rows)

    loader = create_dataloader(gsm8k_rows, cfg, 0, 1, collate_fn=collate, seed=2)
    try:
        assert _steps(ex, engine, loader, 1) == [batch[0]]
        pending = ex.pending_rows()  # batch 1: taken from the loader, queued behind version 1
        assert [row["id"] for row in pending] == order[BSZ : 2 * BSZ]
        state = loader.state_dict()
    finally:
        ex.destroy()  # the kill: batch 1's rollouts are lost
    resumed, engine = _executor(k=0, version=1)
    restored = create_dataloader(gsm8k_rows, cfg, 0, 1, seed=2)
    restored.load_state_dict(state)
    resumed.replay_first(pending)
    try:
        # Not batch 2: batch 1 is generated again with the restored weights and trained first.
        assert _steps(resumed, engine, restored, 2) == [batch[1], batch[2]]
    finally:
        resumed.destroy()


def _taken_prefix(order: list[int], trained: list[int], pending: list[int]) -> int:
    """The rows trained plus those pending are, as a multiset, a prefix of the loader's order (its length):
    no row trained twice (more often than the loader yielded it), none skipped."""
    n = len(trained) + len(pending)
    assert Counter(trained) + Counter(pending) == Counter(order[:n]), (trained, pending, order[:n])
    return n


def test_async_resume_trains_every_row_once(gsm8k_rows: Any) -> None:
    """k=1: which in-flight rows fill a step depends on timing, the rows' accounting does not."""
    order = _loader_order(gsm8k_rows, 60 * BSZ)
    cfg = DatasetConfig(batch_size=BSZ, shuffle=True)
    ex, engine = _executor(k=1)
    loader = create_dataloader(gsm8k_rows, cfg, 0, 1, seed=2)
    try:
        trained = sum(_steps(ex, engine, loader, 5), [])
        pending, state = ex.pending_rows(), loader.state_dict()
    finally:
        ex.destroy()
    _taken_prefix(order, trained, [row["id"] for row in pending])
    resumed, engine = _executor(k=1, version=5)
    restored = create_dataloader(gsm8k_rows, cfg, 0, 1, seed=2)
    restored.load_state_dict(state)
    resumed.replay_first(pending)
    try:
        trained += sum(_steps(resumed, engine, restored, 15), [])  # past the 12-batch epoch end
        final = [row["id"] for row in resumed.pending_rows()]
    finally:
        resumed.destroy()
    assert len(trained) == 20 * BSZ
    assert _taken_prefix(order, trained, final) > len(gsm8k_rows)


@pytest.mark.parametrize(
    ("file", "content", "needle"),
    [
        ("pending_rows_rank0.pt", None, "No such file"),
        ("pending_rows_rank0.pt", {"id": 1}, "must hold a list of rows"),
        ("ledger_rank0.json", {"generated": [1, 1]}, "ledger state lacks ['consumed'"),
    ],
)
def test_corrupt_pending_rows_or_ledger_are_a_one_line_error(
    tmp_path: Path, file: str, content: Any, needle: str
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(4)), batch_size=2)
    ex, _ = _executor(k=0)
    handler = _handler(tmp_path, "auto", RecoverStates({}, None, loader, None, None, rollout=ex))
    os.makedirs(handler.path)
    state = {"global_step": 1, "version": 2, "world_size": 1, "weights_fingerprint": "x"}
    Path(handler.path, LOOP_STATE_FILE).write_text(json.dumps(state))
    torch.save(loader.state_dict(), Path(handler.path, "dataloader_rank0.pt"))
    if file.endswith(".json"):  # the ledger is read after the pending rows
        torch.save([], Path(handler.path, "pending_rows_rank0.pt"))
        Path(handler.path, file).write_text(json.dumps(content))
    elif content is not None:
        torch.save(content, Path(handler.path, file))
    try:
        with pytest.raises(CorruptCheckpointError) as exc:
            handler.load()
    finally:
        ex.destroy()
    msg = str(exc.value)
    assert "\n" not in msg and file in msg and needle in msg, msg


class _FileEngine:
    """A recoverable engine whose whole state is one tensor, saved as a file (no process group)."""

    has_optimizer = True

    def __init__(self, value: float) -> None:
        self.weight, self.version, self.loaded_from = torch.tensor([value]), 0, ""

    def save(self, meta: SaveLoadMeta) -> None:
        os.makedirs(meta.path, exist_ok=True)
        torch.save((self.weight, self.version), os.path.join(meta.path, "state.pt"))

    def load(self, meta: SaveLoadMeta) -> None:
        self.weight, self.version = torch.load(os.path.join(meta.path, "state.pt"))
        self.loaded_from = meta.path

    def get_version(self) -> int:
        return self.version

    def iter_hf_params(self) -> Any:
        yield "w", self.weight


class _NoState:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_checkpoint_found_corrupt_never_becomes_the_previous_one(tmp_path: Path) -> None:
    """A run resumed from recover.prev because the newest checkpoint was corrupt: its next save replaces the
    corrupt one and keeps the good previous one as recover.prev (it used to move the corrupt one there and
    delete the good one)."""
    engine = _FileEngine(1.0)
    first = _handler(tmp_path, "auto", RecoverStates({"model": engine}, engine, None, _NoState(), _NoState()))
    assert first.dump(0, 0) and first.dump(1, 1)
    (Path(first.path) / "engines" / "model" / "state.pt").write_bytes(b"cut short")  # step 2's shard damaged
    again = _FileEngine(0.0)
    resumed = _handler(tmp_path, "auto", RecoverStates({"model": again}, again, None, _NoState(), _NoState()))
    state = resumed.load()
    assert state is not None and state.global_step == 0 and again.loaded_from.startswith(first.path + ".prev")
    assert resumed.dump(1, 1)
    check_manifest(first.path)
    check_manifest(first.path + ".prev")  # the good one, still there
    prev = json.loads(Path(first.path + ".prev", LOOP_STATE_FILE).read_text())
    assert prev["global_step"] == 0
