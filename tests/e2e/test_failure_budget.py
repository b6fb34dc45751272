"""The rollout failure budget (issue 33 item 2): hand cases of the bound, and an executor whose every
episode drops its group stopping at exactly the bound with the cause in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_executor import ToyWorkflow, make_executor, make_loader
from test_launcher import _grpo_args, _run
from vllm_server import RunningServer

from tandemrl.api.episode import note_failure
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient
from tandemrl.rollout.failure_budget import FailureBudget, FailureBudgetExceeded


def test_consecutive_drops_spend_the_budget_and_a_success_resets_the_run() -> None:
    budget = FailureBudget(max_consecutive=3, max_share=1.0, window=10)
    cause = [("reward raised KeyError", "reward function f raised KeyError: 'answer'")]
    assert [budget.record(True, cause), budget.record(True, cause), budget.record(False, [])] == [None] * 3
    assert budget.record(True, cause) is None and budget.record(True, cause) is None
    line = budget.record(True, [("reward timeout", "reward function f timed out after 15s")])
    assert line == (
        "rollout failure budget spent: 3 groups in a row were dropped (rollout.max_consecutive_drops=3); "
        "5 of 6 groups dropped so far, most often reward raised KeyError (4 times), "
        "first: reward function f raised KeyError: 'answer'"
    )


def test_a_share_over_the_window_spends_the_budget_only_once_the_window_is_full() -> None:
    budget = FailureBudget(max_consecutive=0, max_share=0.5, window=4)  # consecutive check off
    outcomes = [True, True, True, False, True]
    lines = [budget.record(d, []) for d in outcomes]
    assert lines[:4] == [None] * 4  # the window of 4 is not full before the 4th, which did not drop
    assert lines[4] is not None and "3 of the last 4 groups were dropped (rollout.max_dropped_share=0.5)" in lines[4]
    assert "4 of 5 groups dropped so far, most often workflow returned None (4 times)" in lines[4]
    with pytest.raises(ValueError, match="0 <= max_dropped_share <= 1"):
        FailureBudget(1, 1.5, 4)


def test_a_share_of_zero_stops_at_the_first_drop_of_a_full_window() -> None:
    budget = FailureBudget(max_consecutive=0, max_share=0.0, window=3)
    assert [budget.record(d, []) for d in (False, True, False)][:2] == [None, None]  # window not full before the 3rd
    line = budget.record(True, [])
    assert line is not None and "2 of the last 3 groups were dropped (rollout.max_dropped_share=0)" in line


class AlwaysFailing(ToyWorkflow):
    """Every episode notes a reward failure and drops its group."""

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        await super().arun_episode(engine, data)
        note_failure("reward raised ZeroDivisionError", "reward function bad raised ZeroDivisionError: boom")
        return None


def test_a_run_whose_every_group_drops_stops_at_the_bound_with_its_cause() -> None:
    ex, _ = make_executor(k=1, bsz=2, max_conc=4, max_consecutive_drops=6)
    try:
        with pytest.raises(FailureBudgetExceeded) as err:
            ex.prepare_batch(make_loader(bsz=2), AlwaysFailing(), timeout=60)
        assert str(err.value).startswith("rollout failure budget spent: 6 groups in a row were dropped")
        assert "first: reward function bad raised ZeroDivisionError: boom" in str(err.value)
        assert "\n" not in str(err.value)
        # The episodes still running when the budget was spent finish, and stop there: nothing new starts.
        assert 6 <= ex.failure_budget.dropped <= 6 + 4
    finally:
        ex.destroy()


@pytest.mark.slow
def test_an_always_failing_reward_stops_the_launched_run_in_one_line(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """Through the real launcher and vLLM server (the session's): a reward that always raises stops the run once
    8 groups in a row dropped, and the launcher's summary line is the budget's line with the reward's first error."""
    args = _grpo_args("tests/workers/grpo_failing_reward.py", tiny_model_dir, gsm8k_dir, tmp_path, 3, 8)
    proc = _run([*args, "rollout.max_consecutive_drops=8"], timeout=900, server=running_server)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("[launcher] trial trial0 failed: ")]
    assert len(failed) == 1, proc.stdout[-3000:]
    assert "rollout failure budget spent: 8 groups in a row were dropped (rollout.max_consecutive_drops=8)" in failed[0]
    assert "most often reward raised ZeroDivisionError" in failed[0]
    assert "first: reward function always_fails raised ZeroDivisionError: division by zero" in failed[0]
