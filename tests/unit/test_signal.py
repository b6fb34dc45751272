"""A run whose updates carry no learning signal says so: a warning after N such steps, a count at the end.

The stats are the keys the PPO actor exports (``actor/ppo_actor/advantages/min|max``, ``.../update/grad_norm``,
as in a real run's stats.jsonl); the launcher test (tests/e2e/test_launcher.py) checks the closing line of real runs
against their stats.jsonl.
"""

from __future__ import annotations

import pytest

from tandemrl.configs import GRPOConfig
from tandemrl.configs.loader import ConfigError
from tandemrl.trainers.entry import load_script_config as load_config
from tandemrl.trainers.signal import SignalWatch, no_signal_reason

FLAT = {"actor/ppo_actor/advantages/min": 0.0, "actor/ppo_actor/advantages/max": 0.0, "rollout/reward": 0.0}
LEARNING = {
    "actor/ppo_actor/advantages/min": -0.5,
    "actor/ppo_actor/advantages/max": 1.5,
    "actor/ppo_actor/update/grad_norm": 0.16,
}
NO_GRAD = {**LEARNING, "actor/ppo_actor/update/grad_norm": 0.0}


def test_zero_advantages_or_zero_gradients_are_no_signal() -> None:
    assert no_signal_reason(FLAT) == "all advantages 0: every group's samples earned the same reward"
    assert no_signal_reason(NO_GRAD) == "grad_norm 0 on every update"
    assert no_signal_reason(LEARNING) is None
    assert no_signal_reason({"rollout/reward": 0.0}) is None  # nothing recorded: not judged


def test_warns_once_after_n_steps_in_a_row_and_counts_them_for_the_closing_line() -> None:
    watch = SignalWatch(warn_after=3)
    warnings = [watch.observe(s) for s in (FLAT, FLAT, LEARNING, FLAT, NO_GRAD, FLAT, FLAT, FLAT)]
    assert [i for i, w in enumerate(warnings) if w] == [5]  # the first streak of 3 (steps 3..5), once
    assert warnings[5] is not None and warnings[5].startswith("warning: no learning signal for 3 steps in a row (")
    assert watch.closing() == (
        "7 of 8 steps carried no learning signal (all advantages 0: every group's samples earned the same reward)"
    )
    quiet = SignalWatch(warn_after=0)
    assert [quiet.observe(FLAT) for _ in range(5)] == [None] * 5 and quiet.closing() is not None
    fine = SignalWatch(warn_after=1)
    assert fine.observe(LEARNING) is None and fine.closing() is None


def test_the_threshold_is_a_config_field_with_bounds() -> None:
    config, _ = load_config(["warn_no_signal_steps=5", "allocation_mode=vllm:d1+fsdp:d1"], GRPOConfig)
    assert config.warn_no_signal_steps == 5
    with pytest.raises(ConfigError, match="'warn_no_signal_steps' on the command line .* must be >= 0, got -1"):
        load_config(["warn_no_signal_steps=-1", "allocation_mode=vllm:d1+fsdp:d1"], GRPOConfig)
