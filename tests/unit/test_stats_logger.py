"""StatsLogger writes wandb offline runs and TensorBoard scalars, and prints a table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.utils import StatsLoggerConfig, TensorBoardConfig, WandBConfig
from tandemrl.trainers.stats_logger import StatsLogger, format_table


def _config(tmp_path: Path, wandb_mode: str = "disabled", tb: bool = False) -> StatsLoggerConfig:
    return StatsLoggerConfig(
        experiment_name="exp",
        trial_name="trial0",
        fileroot=str(tmp_path / "root"),
        wandb=WandBConfig(mode=wandb_mode, project="tandemrl-test"),
        tensorboard=TensorBoardConfig(path=str(tmp_path / "tb") if tb else None),
    )


def test_offline_wandb_and_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    cfg = _config(tmp_path, wandb_mode="offline", tb=True)
    spec = FinetuneSpec(total_train_epochs=2, dataset_size=8, train_batch_size=4)
    logger = StatsLogger(cfg, spec)
    try:
        logger.commit(0, 0, 0, {"loss/avg": 0.5, "reward": torch.tensor(1.0), "reward__count": 3.0})
        logger.commit(0, 1, 1, [{"loss/avg": 0.25}, {"loss/avg": 0.125, "lr": 1e-5}])
    finally:
        logger.close()
    logger.close()  # idempotent

    assert logger.log_dir == str(tmp_path / "root" / "logs" / "exp" / "trial0")
    runs = list((Path(logger.log_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "offline run has no .wandb data file"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/avg", "reward", "lr"} <= tags
    assert "reward__count" not in tags
    loss = [(e.step, e.value) for e in acc.Scalars("loss/avg")]
    assert loss == [(0, pytest.approx(0.5)), (1, pytest.approx(0.125))]  # later dict in a list wins

    printed = capsys.readouterr().out
    assert "epoch 1/2 step 2/2 global step 2/4" in printed
    assert "__count" not in printed


def test_console_table_sorted():
    table = format_table({"b": 2.0, "a/long_key": 0.123456}).splitlines()
    assert table[0].startswith("a/long_key") and table[0].endswith("0.1235")
    assert table[1].startswith("b ") and table[1].endswith("2")


def test_disabled_backends_write_nothing(tmp_path: Path, capsys):
    cfg = _config(tmp_path)
    cfg.console = cfg.jsonl = False
    logger = StatsLogger(cfg, None)
    logger.commit(0, 0, 0, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "root").exists()
    assert capsys.readouterr().out == ""


def test_bad_values_and_mode(tmp_path: Path):
    logger = StatsLogger(_config(tmp_path), None)
    with pytest.raises(TypeError, match="'name'"):
        logger.commit(0, 0, 0, {"name": "abc"})
    with pytest.raises(ValueError, match="'vec'"):
        logger.commit(0, 0, 0, {"vec": torch.ones(2)})
    with pytest.raises(ValueError, match="wandb.mode"):
        StatsLogger(_config(tmp_path, wandb_mode="cloud"), None)


def test_jsonl_and_curves_png(tmp_path: Path, capsys):
    logger = StatsLogger(_config(tmp_path), None)
    rewards = [0.1, 0.3, 0.6]
    for i, r in enumerate(rewards):
        stats = {
            "rollout/reward": r,
            "actor/ppo_actor/response_len/avg": 40.0 + i,
            "actor/ppo_actor/update/approx_kl/avg": 0.01 * i,
            "actor/ppo_actor/update/offpolicy/kl_k3": 0.002,
        }
        if i == 2:
            stats["eval-rollout/accuracy"] = 0.5
        logger.commit(0, i, i, stats)
    logger.draw_curves()  # the RL loop draws before its last line
    logger.close()  # close after draw_curves, and a second close, draw nothing more
    logger.close()

    from tandemrl.trainers.plots import _series, read_stats

    rows = read_stats(str(Path(logger.log_dir) / "stats.jsonl"))
    assert sorted(rows) == [1, 2, 3]  # steps are global step + 1
    assert _series(rows, r"^rollout/reward$") == ("rollout/reward", [1, 2, 3], rewards)
    assert _series(rows, r"^eval-rollout/accuracy$") == ("eval-rollout/accuracy", [3], [0.5])
    png = Path(logger.log_dir) / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as img:
        assert img.size[1] > img.size[0]  # four stacked panels
    assert capsys.readouterr().out.count(str(png)) == 1


def test_plot_skips_empty_and_names_bad_line(tmp_path: Path):
    from tandemrl.trainers.plots import plot_curves

    path = tmp_path / "stats.jsonl"
    path.write_text('{"step": 1, "unrelated": 1.0}\n')
    assert plot_curves(str(path)) is None
    path.write_text('{"step": 1, "rollout/reward": 1.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"stats.jsonl:2: not a JSON line"):
        plot_curves(str(path))


def test_curves_show_heldout_truncation_and_signal(tmp_path: Path) -> None:
    """curves.png's panels: held-out before/after (from the files HeldoutEval writes, with their intervals)
    at the weight versions scored, the truncation rate and the share of groups with a non-zero advantage."""
    from tandemrl.configs.utils import HeldoutEvalConfig
    from tandemrl.trainers.heldout import HeldoutEval, HeldoutScore
    from tandemrl.trainers.plots import curve_panels, plot_curves
    from tandemrl.workflows.gsm8k_eval import EvalResult, wilson_interval

    logger = StatsLogger(_config(tmp_path), None)
    for i, (trunc, signal) in enumerate([(0.5, 0.25), (0.25, 0.75), (0.0, 1.0)]):
        stats = {"rollout/reward": 0.1 * i, "rollout/truncated": trunc, "actor/ppo_actor/groups_with_signal": signal}
        logger.commit(0, i, i, stats)
    logger.close()
    heldout = HeldoutEval(
        HeldoutEvalConfig(
            n=0, path="unused", experiment_name="exp", trial_name="trial0", fileroot=str(tmp_path / "root")
        ),
        None,
    )
    for tag, version, correct in (("before", 0, 20), ("after", 3, 90)):
        low, high = wilson_interval(correct, 200)
        result = EvalResult(200, correct, correct / 200, low, high, 128, True, 1.0)
        heldout._write(HeldoutScore(tag, version, result))
    jsonl = str(Path(logger.log_dir) / "stats.jsonl")
    panels = dict(curve_panels(jsonl))
    accuracy = dict(panels["greedy accuracy"])
    _, steps, values, intervals = accuracy["held-out, 200 questions (95% interval)"]
    assert steps == [0, 3] and values == [0.1, 0.45]
    assert intervals == [wilson_interval(20, 200), wilson_interval(90, 200)]
    (_, (key, steps, values, _)), *_ = panels["truncation rate (samples at max_new_tokens)"]
    assert (key, steps, values) == ("rollout/truncated", [1, 2, 3], [0.5, 0.25, 0.0])
    (_, (key, steps, values, _)), *_ = panels["groups with a non-zero advantage (share)"]
    assert (key, values) == ("actor/ppo_actor/groups_with_signal", [0.25, 0.75, 1.0])
    assert plot_curves(jsonl) == str(Path(logger.log_dir) / "curves.png")
