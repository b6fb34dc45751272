"""The pipeline metrics of docs/metrics.md on hand cases: shares of a step, token-weighted staleness,
and an episode's environment wait as the executor records it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from test_executor import ToyWorkflow, make_executor, wait_until

from tandemrl.api import episode
from tandemrl.api.episode import note_waited, waiting
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient
from tandemrl.trainers.pipeline_metrics import oldest_version_lag, pipeline_shares, record_staleness
from tandemrl.utils import stats_tracker


def test_shares_of_a_step_averaged_over_two_ranks() -> None:
    # Each timing is the mean over both ranks' calls; the busy clock is one call per rank.
    step = {
        "timeperf/rollout_wait": 4.0,
        "timeperf/rollout_wait__count": 2.0,
        "timeperf/update_weights": 0.5,
        "timeperf/update_weights__count": 2.0,
        "timeperf/step": 10.0,
        "timeperf/step__count": 2.0,
        "rollout/timeperf/server_busy": 7.5,
        "rollout/timeperf/server_busy__count": 2.0,
    }
    assert pipeline_shares(step, n_ranks=2) == pytest.approx(
        {"pipeline/trainer_idle": 0.4, "pipeline/weight_sync": 0.05, "pipeline/server_idle": 0.25}
    )
    # A phase that did not run is a 0 share, not a missing key; no step timing, no shares.
    assert pipeline_shares({"timeperf/step": 2.0}, 1) == {"pipeline/trainer_idle": 0.0, "pipeline/weight_sync": 0.0}
    assert pipeline_shares({"timeperf/rollout_wait": 1.0}, 1) == {}


def test_staleness_counts_each_sample_at_its_oldest_token_weighted_by_tokens() -> None:
    # Row 0: 3 trained tokens of versions 3, 4, 4 (oldest 3); row 1: 2 tokens of versions 2, 4 (oldest 2).
    versions = torch.tensor([[-1, 3, 4, 4], [-1, -1, 2, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    lag = oldest_version_lag(versions, mask, trainer_version=5)
    assert lag.tolist() == [[0, 2, 2, 2], [0, 0, 3, 3]]
    tracker = stats_tracker.DEFAULT_TRACKER
    tracker.export(reset=True)
    record_staleness(versions, mask, trainer_version=5)
    out = tracker.export()
    assert out["pipeline/staleness/avg"] == pytest.approx(12 / 5)  # (3 x 2 + 2 x 3) / 5 tokens
    assert (out["pipeline/staleness/max"], out["pipeline/trained_tokens"]) == (3.0, 5.0)


class WaitingWorkflow(ToyWorkflow):
    """Reports 1.5 s of tool wait for its row, then 2.5 s through ``waiting()`` on a stepped clock."""

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        note_waited(1.5)
        with waiting():
            await asyncio.sleep(0)
        return await super().arun_episode(engine, data)


def test_an_episodes_environment_wait_is_logged_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(episode, "_now", lambda: next(ticks))
    ex, _ = make_executor(k=0, bsz=1, max_conc=1)
    try:
        ex.export_stats()  # what earlier executors in this process left in the "rollout" tracker
        ex.submit({"id": 1}, WaitingWorkflow())
        wait_until(lambda: ex.get_stats().accepted == 1, "the episode finished")
        ex.wait(1, timeout=10)
        out = ex.export_stats()
        assert (out["rollout/env_wait"], out["rollout/env_wait__count"]) == (4.0, 1.0)
        assert out["rollout/in_flight"] == 0.0
    finally:
        ex.destroy()
    note_waited(3.0)  # outside an episode: nothing to add to, no error
    with pytest.raises(ValueError, match="note_waited: seconds must be a number >= 0"):
        note_waited(-1.0)
