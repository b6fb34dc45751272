"""Episodes that are not one whole group drop their group instead of stopping the run
(``tandemrl.rollout.whole_groups``; the trainer's controller wraps every workflow in it for groups > 1).

Found by the agentic benchmark: an agent whose first call was cut at max_new_tokens split its session into
two trajectories, so its episode returned 7 rows for a group of 4 and GRPO's normalisation ended the run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_executor import N_SAMPLES, ToyWorkflow, make_executor, make_loader

from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient
from tandemrl.rollout.failure_budget import FailureBudgetExceeded
from tandemrl.rollout.ledger import Tally, tally_of
from tandemrl.rollout.whole_groups import WholeGroups


class OddRowsOnOddIds(ToyWorkflow):
    """Rows with an odd id return one row more than their group (their rows generated, not noted)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = Tally()

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        traj = await super().arun_episode(engine, data)
        assert traj is not None
        if int(data["id"]) % 2 == 0:
            return traj
        doubled = {k: torch.cat([v, v[:1]]) for k, v in traj.items()}
        self.extra += tally_of(doubled)
        return doubled


def test_an_episode_of_another_size_drops_its_group_and_is_counted() -> None:
    ex, _ = make_executor(k=0, bsz=4, max_conc=4)
    wf = OddRowsOnOddIds()
    try:
        batch = ex.rollout_batch([{"id": i} for i in range(4)], WholeGroups(wf, N_SAMPLES), timeout=30)
        totals = ex.ledger_totals()
    finally:
        ex.destroy()
    # Odd rows drop; rollout_batch refills round-robin until it has 4 whole groups, all from even rows.
    assert batch["attention_mask"].shape[0] == 4 * N_SAMPLES
    assert sorted(set(batch["prompt_id"].tolist())) == [0, 2]
    totals.check()
    dropped = wf.extra.samples // (N_SAMPLES + 1)  # odd episodes run, each N_SAMPLES + 1 rows
    assert dropped >= 2 and totals.discarded["group_dropped"] == wf.extra
    assert totals.groups_dropped == dropped


def test_a_workflow_that_never_returns_a_whole_group_spends_the_budget_naming_it() -> None:
    ex, _ = make_executor(k=1, bsz=2, max_conc=2, max_consecutive_drops=3)

    class AlwaysOdd(OddRowsOnOddIds):
        async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
            return await super().arun_episode(engine, {"id": 2 * int(data["id"]) + 1})

    try:
        with pytest.raises(FailureBudgetExceeded) as err:
            ex.prepare_batch(make_loader(bsz=2), WholeGroups(AlwaysOdd(), N_SAMPLES), timeout=60)
    finally:
        ex.destroy()
    line = str(err.value)
    assert "most often episode not one group" in line
    assert (
        f"first: AlwaysOdd returned {N_SAMPLES + 1} rows for one prompt; the trainer's groups need {N_SAMPLES}" in line
    )


def test_whole_groups_and_none_pass_through() -> None:
    ex, _ = make_executor(k=0, bsz=2, max_conc=2)
    try:
        batch = ex.rollout_batch([{"id": 0}, {"id": 2}], WholeGroups(ToyWorkflow(), N_SAMPLES), timeout=30)
    finally:
        ex.destroy()
    assert batch["prompt_id"].tolist() == [0] * N_SAMPLES + [2] * N_SAMPLES
    with pytest.raises(ValueError, match="rows must be >= 1"):
        WholeGroups(ToyWorkflow(), 0)
