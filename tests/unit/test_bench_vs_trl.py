"""bench/vs_trl.py gives tandemrl and TRL the same workload (no TRL needed: only the configs are built), and
--repeats interleaves the sides and summarizes them (medians, per-pair ratios) as computed by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandemrl.data.gsm8k import render_prompts
from tandemrl.models.hf import load_hf_tokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vs_trl.py"
# Non-default values for every workload flag, so a flag wired to one side only shows up.
FLAGS = "--steps 3 --prompts 2 --group-size 3 --new-tokens 16 --max-prompt-len 120 --temperature 0.7 --lr 3e-5"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def workload(bench: ModuleType, model_dir: str, gsm8k_dir: str, argv: str = FLAGS):
    return bench.workload(bench.parse_args([*argv.split(), "--data", gsm8k_dir]), model_dir)


def test_both_sides_get_the_same_workload(bench: ModuleType, tiny_model_dir: str, gsm8k_dir: str) -> None:
    w = workload(bench, tiny_model_dir, gsm8k_dir)
    extra = ["actor.engine.mixed_precision=bfloat16", "async_training=false"]
    cfg = bench.tandemrl_config(w, "/tmp/unused-fileroot", extra)  # tandemrl's own config loader
    trl = bench.trl_args(w, "/tmp/unused-trl-out", ["beta=0.04", "bf16=true"])

    assert cfg.actor.engine.path == w.model_dir == tiny_model_dir
    assert cfg.total_train_steps == trl["max_steps"] == 3
    assert cfg.gconfig.n_samples == cfg.actor.group_size == trl["num_generations"] == 3
    assert cfg.train_dataset.batch_size * cfg.gconfig.n_samples == trl["per_device_train_batch_size"] == 6
    assert cfg.gconfig.max_new_tokens == cfg.gconfig.min_new_tokens == trl["max_completion_length"] == 16
    assert trl["generation_kwargs"] == {"min_new_tokens": 16}  # EOS held back to the same length on both sides
    assert cfg.gconfig.temperature == trl["temperature"] == pytest.approx(0.7)
    assert cfg.actor.engine.optimizer.lr == trl["learning_rate"] == pytest.approx(3e-5)
    assert cfg.train_dataset.shuffle is False and trl["shuffle_dataset"] is False
    assert cfg.train_dataset.max_length == 120
    # Placement flags reach tandemrl only; the main job's settings stay otherwise.
    assert cfg.actor.engine.mixed_precision == "bfloat16" and cfg.async_training is False
    assert cfg.allocation_mode == "vllm:d1+fsdp:d1"
    # Neither side saves inside its measured loop (tandemrl's final save would be its last step's).
    assert cfg.saver.save_final is False and trl["save_strategy"] == "no"
    assert trl["beta"] == pytest.approx(0.04) and trl["bf16"] is True and trl["use_vllm"] is False


def test_default_workload_is_the_issue_measurement(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.model == "25m" and bench.MODELS["25m"]["hidden"] == 512 and bench.MODELS["tiny"] == {}
    w = bench.workload(args, "/m")
    assert (w.prompts, w.group_size, w.new_tokens, w.temperature, w.steps) == (8, 4, 64, 1.0, 10)
    assert bench.parse_args(["--model", "tiny"]).model == "tiny"
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "7b"])


def test_trl_gets_tandemrl_prompts_step_by_step(bench: ModuleType, tiny_model_dir: str, gsm8k_dir: str) -> None:
    w = workload(bench, tiny_model_dir, gsm8k_dir)
    rows = bench.prompt_rows(bench.tandemrl_config(w, "/tmp/unused-fileroot", []))

    # Independently: the first rows of train.jsonl whose chat prompt fits 120 tokens, in file order.
    lines = (Path(gsm8k_dir) / "train.jsonl").read_text().splitlines()[:200]
    questions = [json.loads(line)["question"] for line in lines]
    lengths = [len(ids) for ids in render_prompts(load_hf_tokenizer(tiny_model_dir), questions)]
    expected = [i for i, n in enumerate(lengths) if n <= 120][: w.steps * w.prompts]
    assert [row["id"] for row in rows] == expected
    assert [row["prompt"] for row in rows] == [[{"role": "user", "content": questions[i]}] for i in expected]
    assert all("####" in row["answer"] for row in rows)


@pytest.mark.parametrize(
    ("flag", "value", "key"),
    [
        ("--tandemrl-overrides", "gconfig.n_samples=8", "gconfig.n_samples"),
        ("--tandemrl-overrides", "actor.engine.mixed_precision=bfloat16 total_train_steps=2", "total_train_steps"),
        ("--trl-args", "num_generations=8", "num_generations"),
        ("--trl-args", "max_completion_length=8", "max_completion_length"),
    ],
)
def test_workload_keys_are_refused_in_extra_flags(
    bench: ModuleType, tiny_model_dir: str, gsm8k_dir: str, flag: str, value: str, key: str
) -> None:
    w = workload(bench, tiny_model_dir, gsm8k_dir)
    extra = value.split()
    with pytest.raises(SystemExit, match=f"{flag} may not set {key}:"):
        if flag == "--trl-args":
            bench.trl_args(w, "/tmp/x", extra)
        else:
            bench.tandemrl_config(w, "/tmp/x", extra)


def test_summarize_an_odd_count_of_pairs(bench: ModuleType) -> None:
    s = bench.summarize([40.0, 44.0, 42.0], [30.0, 40.0, 35.0])
    assert s.ratios == pytest.approx((4 / 3, 1.1, 1.2))
    assert s.ratio_median == pytest.approx(1.2) and s.ratio_range == pytest.approx((1.1, 4 / 3))
    assert s.tandemrl_median == 42.0 and s.tandemrl_range == (40.0, 44.0)
    assert s.trl_median == 35.0 and s.trl_range == (30.0, 40.0)


def test_summarize_an_even_count_takes_the_mean_of_the_middle_two(bench: ModuleType) -> None:
    s = bench.summarize([10.0, 30.0, 20.0, 40.0], [10.0, 10.0, 10.0, 10.0])
    assert s.ratios == pytest.approx((1.0, 3.0, 2.0, 4.0))
    assert s.ratio_median == pytest.approx(2.5) and s.ratio_range == pytest.approx((1.0, 4.0))
    assert s.tandemrl_median == 25.0 and s.trl_median == 10.0 and s.trl_range == (10.0, 10.0)


def test_summarize_one_side_has_no_ratios(bench: ModuleType) -> None:
    s = bench.summarize([], [5.0, 7.0])  # --only trl
    assert s.trl_median == 6.0 and s.trl_range == (5.0, 7.0)
    assert s.tandemrl_median is None and s.tandemrl_range is None
    assert s.ratios == () and s.ratio_median is None and s.ratio_range is None


def test_summarize_refuses_mismatched_or_no_runs(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="3 tandemrl runs but 2 TRL runs"):
        bench.summarize([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no runs"):
        bench.summarize([], [])


def test_repeats_flag(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.parse_args([]).repeats == 1 and bench.parse_args(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--repeats", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "--repeats must be >= 1" in err


def _fake_runs(bench: ModuleType, monkeypatch: pytest.MonkeyPatch, rates: dict[str, list[float]]) -> list[str]:
    """Replace both sides by stubs that log ``side:folder`` and return the next of their ``rates``."""
    calls: list[str] = []

    def side(name: str, where: Path) -> object:
        calls.append(f"{name}:{where.name}")
        return bench.Result(name, 32 / rates[name].pop(0), 32, 64, 64.0)

    monkeypatch.setattr(bench, "run_tandemrl", lambda w, where, *_: side("tandemrl", where))
    monkeypatch.setattr(bench, "run_trl", lambda w, where, *_: side("TRL", where))
    return calls


def test_repeats_interleave_the_sides_one_folder_per_run(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    calls = _fake_runs(bench, monkeypatch, {"tandemrl": [40.0, 44.0, 42.0], "TRL": [30.0, 40.0, 35.0]})
    args = bench.parse_args(["--repeats", "3"])
    bench.run_all(args, bench.workload(args, "/m"), tmp_path, [], ([], []))
    assert calls == ["tandemrl:run1", "TRL:run1", "tandemrl:run2", "TRL:run2", "tandemrl:run3", "TRL:run3"]
    out = capsys.readouterr().out
    assert "run 2/3 TRL: 40.00 samples/s; load average " in out
    assert "tandemrl: median 42.00 samples/s, min-max 40.00-44.00 over 3 runs" in out
    assert "TRL: median 35.00 samples/s, min-max 30.00-40.00 over 3 runs" in out
    assert "tandemrl / TRL per pair: 1.33x, 1.10x, 1.20x" in out
    assert "tandemrl / TRL: median 1.20x samples/s, spread 1.10-1.33x over 3 pairs" in out
    assert "load average (1/5/15 min): start " in out


def test_one_run_keeps_the_workdir_layout_and_only_repeats_one_side(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    calls = _fake_runs(bench, monkeypatch, {"tandemrl": [40.0], "TRL": [32.0, 16.0, 32.0]})
    args = bench.parse_args([])
    bench.run_all(args, bench.workload(args, "/m"), tmp_path, [], ([], []))
    assert calls == ["tandemrl:" + tmp_path.name, "TRL:" + tmp_path.name] and not list(tmp_path.iterdir())
    assert "tandemrl / TRL: 1.25x samples/s" in capsys.readouterr().out
    args = bench.parse_args(["--only", "trl", "--repeats", "2"])
    calls.clear()
    bench.run_all(args, bench.workload(args, "/m"), tmp_path, [], ([], []))
    assert calls == ["TRL:run1", "TRL:run2"]
    out = capsys.readouterr().out
    assert "TRL: median 24.00 samples/s, min-max 16.00-32.00 over 2 runs" in out and "tandemrl /" not in out
