"""The closing time split of an RL run, from the exported ``timeperf/`` stats of its steps (hand cases)."""

from __future__ import annotations

import pytest

from tandemrl.trainers.time_split import add_step_timings, format_time_split


def test_phases_add_up_over_steps_calls_and_ranks() -> None:
    totals: dict[str, float] = {}
    # Two DP ranks: each exported timing is the mean over both ranks' calls, key__count their number.
    step = {
        "timeperf/rollout_wait": 3.0,
        "timeperf/rollout_wait__count": 2.0,
        "timeperf/actor/recompute_logp": 1.0,
        "timeperf/actor/recompute_logp__count": 2.0,
        "timeperf/actor/ppo_actor/update/fwd_bwd": 2.0,  # two minibatches on each rank
        "timeperf/actor/ppo_actor/update/fwd_bwd__count": 4.0,
        "timeperf/critic/ppo_critic/fwd_bwd": 0.6,
        "timeperf/critic/ppo_critic/fwd_bwd__count": 2.0,
        "timeperf/update_weights": 0.5,
        "timeperf/save": 0.25,
        "timeperf/eval": 0.25,
        "timeperf/train_step": 5.0,  # contains fwd_bwd: not counted again
        "timeperf/step": 12.0,
        "timeperf/step__count": 2.0,
        "actor/recompute_skipped": 0.0,
    }
    add_step_timings(totals, step, n_ranks=2)
    second = {"timeperf/rollout_wait": 1.0, "timeperf/rollout_wait__count": 2.0, "timeperf/step": 8.0}
    add_step_timings(totals, second, n_ranks=2)
    assert totals == pytest.approx(
        {
            "rollout wait (trainer idle)": 4.0,
            "recompute": 1.0,
            "fwd+bwd": 4.6,
            "weight sync": 0.5,
            "save/eval": 0.5,
            "step": 20.0,
        }
    )
    line = format_time_split(totals)
    assert line == (
        "time split: rollout wait (trainer idle) 20% | recompute 5% | fwd+bwd 23% | weight sync 2% "
        "| save/eval 2% | other 47%"
    )
    # The servers' busy time (the rollout tracker's) is not a trainer phase: the line ends with their idle share.
    add_step_timings(totals, {"rollout/timeperf/server_busy": 5.0, "rollout/timeperf/server_busy__count": 2.0}, 2)
    assert totals["server_busy"] == pytest.approx(5.0)
    assert format_time_split(totals) == line + "; server idle 75%"
    # Without step timings the phases are the whole.
    assert format_time_split({"fwd+bwd": 3.0, "optimizer": 1.0}) == "time split: fwd+bwd 75% | optimizer 25% | other 0%"


def test_busy_clock_counts_overlapping_requests_once() -> None:
    from tandemrl.inference.busy import BusyClock

    now = [0.0]
    clock = BusyClock(clock=lambda: now[0])
    with clock.running():  # 0 .. 3
        now[0] = 1.0
        with clock.running():  # 1 .. 2, inside the first
            now[0] = 2.0
        now[0] = 3.0
    now[0] = 10.0  # idle 3 .. 10
    assert clock.take() == pytest.approx(3.0)
    with clock.running():  # open across a take: each take counts up to its own time
        now[0] = 12.0
        assert clock.take() == pytest.approx(2.0)
        now[0] = 13.0
    assert clock.take() == pytest.approx(1.0)
    assert clock.take() == 0.0
