"""The sample and token ledger (``tandemrl.rollout.ledger``): the pure accounting, then a
``WorkflowExecutor`` whose episodes leave it every way they can, checked against what the
workflow itself recorded and what the batches handed out hold. The GRPO run through the launcher,
killed and resumed, is in tests/e2e/test_recover.py."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from test_executor import N_SAMPLES, make_executor, make_loader, mixed_rewards, quiesce, wait_until

from tandemrl.api.episode import note_generated
from tandemrl.api.inference import ModelRequest
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.rollout.ledger import REASONS, Ledger, LedgerError, LedgerTotals, Tally
from tandemrl.workflows.rlvr import completion_row

# ------------------------------------------------------------------------------ the accounting


def _every_reason() -> Ledger:
    """22 samples / 220 tokens generated: 4 consumed, then one of each reason (i + 1 samples), 3 waiting."""
    ledger = Ledger()
    ledger.generated(Tally(22, 220))
    ledger.consumed(Tally(4, 40))
    for i, reason in enumerate(r for r in REASONS if r != "too_long"):
        ledger.discarded(reason, Tally(i + 1, 10 * (i + 1)))
    ledger.unconsume("too_long", Tally(1, 10))  # handed out, then masked out of the loss
    for dropped in (False, True, False, True, True):  # 5 groups finished, 3 of them dropped
        ledger.episode(dropped)
    return ledger


def test_the_ledger_balances_with_every_reason_and_reports_each() -> None:
    totals = _every_reason().totals(in_flight=Tally(3, 30), running_episodes=2)
    totals.check()
    stats = totals.stats()
    assert stats["ledger/consumed_samples"] == 3 and stats["ledger/consumed_tokens"] == 30
    assert stats["ledger/discarded/too_long_samples"] == 1 and stats["ledger/discarded/too_long_tokens"] == 10
    assert [stats[f"ledger/discarded/{r}_samples"] for r in REASONS if r != "too_long"] == [1, 2, 3, 4, 5]
    assert stats["ledger/in_flight_samples"] == 3 and stats["ledger/running_episodes"] == 2
    line = totals.line()
    assert "\n" not in line and line.startswith("ledger: generated 22 (220 tokens) = consumed 3 (30 tokens)")
    assert all(f"{r} " in line for r in REASONS) and "in flight 3 (30 tokens)" in line
    assert line.endswith("; groups: 3 of 5 dropped (a reward or workflow failed)")
    assert stats["ledger/groups"] == 5 and stats["ledger/groups_dropped"] == 3


@pytest.mark.parametrize(
    ("in_flight", "message"),
    [
        (Tally(2, 20), "1 samples unaccounted for: generated 22 != consumed 3 + discarded 16 + in flight 2"),
        (Tally(4, 40), "1 samples counted twice: generated 22 != consumed 3 + discarded 16 + in flight 4"),
        (Tally(3, 31), "1 tokens counted twice: generated 220 != consumed 30 + discarded 160 + in flight 31"),
    ],
)
def test_a_violated_ledger_is_one_line_naming_the_gap(in_flight: Tally, message: str) -> None:
    with pytest.raises(LedgerError) as exc:
        _every_reason().totals(in_flight).check()
    assert str(exc.value) == f"sample ledger violated: {message}"


def test_state_round_trip_turns_what_was_in_flight_into_lost_at_restart() -> None:
    saved = json.loads(json.dumps(_every_reason().state_dict(in_flight=Tally(3, 30))))
    restored = Ledger()
    assert restored.load_state_dict(saved) == Tally(3, 30)
    totals = restored.totals(in_flight=Tally())  # a restarted executor has nothing waiting
    totals.check()
    assert totals.discarded["lost_at_restart"] == Tally(5 + 3, 50 + 30)  # the saved 5, plus the 3 in flight
    assert totals.generated == Tally(22, 220) and totals.consumed == Tally(3, 30)
    assert (totals.groups, totals.groups_dropped) == (5, 3)
    del saved["groups"]  # a checkpoint written before groups were counted
    assert Ledger().load_state_dict(saved) == Tally(3, 30)


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ({"generated": [1, 1]}, "ledger state lacks ['consumed', 'discarded', 'in_flight']"),
        (
            {"generated": [1, 1], "consumed": [1, 1], "discarded": {"lost": [0, 0]}, "in_flight": [0, 0]},
            "unknown discard reason 'lost'",
        ),
        (
            {"generated": [1, "1"], "consumed": [1, 1], "discarded": {}, "in_flight": [0, 0]},
            "field 'generated' must be [samples, tokens] integers",
        ),
        (
            {"generated": [1, 1], "consumed": [1, 1], "discarded": {}, "in_flight": [0, 0], "groups": [3]},
            "field 'groups' must be [finished, dropped] integers",
        ),
    ],
)
def test_a_bad_ledger_state_is_a_one_line_error(state: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        Ledger().load_state_dict(state)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_ranks_add_up_through_the_vector() -> None:
    a = _every_reason().totals(Tally(3, 30), 2)
    other = Ledger()
    other.episode(True)
    b = other.totals(Tally(), 1)
    summed = LedgerTotals.from_vector([x + y for x, y in zip(a.to_vector(), b.to_vector(), strict=True)])
    expected = {"ledger/running_episodes": 3.0, "ledger/groups": 6.0, "ledger/groups_dropped": 4.0}
    assert summed.stats() == {**a.stats(), **expected}


# ------------------------------------------------------------------------------ in the executor


class EveryFateWorkflow(RolloutWorkflow):
    """Generates N_SAMPLES per row, then by ``id % 4``: 0 raises, 1 drops the group (returns None),
    2 returns equal rewards (``mixed_rewards`` filters it), 3 returns mixed rewards (accepted).
    Records each row's fate and what it generated, for the test to compare with the ledger, and the ids of the
    rows whose episode returned a trajectory."""

    FATES = ("failed", "group_dropped", "filtered", "accepted")

    def __init__(self) -> None:
        self.generated: list[tuple[str, Tally]] = []
        self.returned_ids: list[int] = []
        self._lock = threading.Lock()

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        pid = int(data["id"])
        prompt = [pid, 7, 8]
        resps = await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=prompt)) for _ in range(N_SAMPLES)])
        fate = self.FATES[pid % 4]
        with self._lock:
            self.generated.append((fate, Tally(N_SAMPLES, sum(len(r.output_tokens) for r in resps))))
        note_generated(N_SAMPLES, sum(len(r.output_tokens) for r in resps))
        if fate == "failed":
            raise ValueError(f"row {pid} failed after generating")
        if fate == "group_dropped":
            return None
        rewards = [1.0, 1.0] if fate == "filtered" else [0.0, 1.0]
        traj = concat_padded_tensors([completion_row(prompt, r, w) for r, w in zip(resps, rewards, strict=True)])
        with self._lock:
            self.returned_ids.append(pid)
        return traj

    def by_fate(self, fate: str) -> Tally:
        return sum((t for f, t in self.generated if f == fate), Tally())


def _tally(batch: TensorDict) -> Tally:
    return Tally(int(batch["attention_mask"].shape[0]), int(batch["loss_mask"].sum()))


def test_executor_ledger_matches_what_the_workflow_generated_and_the_batches_hold() -> None:
    bsz = 2
    ex, _ = make_executor(k=1, bsz=bsz, max_conc=8, workflow_error_policy="drop")
    wf = EveryFateWorkflow()
    handed, loader = Tally(), make_loader(bsz=bsz)
    try:
        for step in range(3):
            batch = ex.prepare_batch(loader, wf, should_accept_fn=mixed_rewards, timeout=30)
            handed += _tally(batch)
            ex.set_version(step + 1)
            ex.ledger_totals().check()  # while episodes still run
        quiesce(ex)
        totals = ex.ledger_totals()
    finally:
        ex.destroy()
    totals.check()
    assert totals.generated == sum((t for _, t in wf.generated), Tally())
    assert totals.consumed == handed and handed.samples == 3 * bsz * N_SAMPLES
    for fate in ("failed", "group_dropped", "filtered"):
        assert totals.discarded[fate] == wf.by_fate(fate) and wf.by_fate(fate).samples > 0, fate
    # What the workflow accepted and no batch took is waiting: in flight, measured from the queue.
    assert totals.in_flight == wf.by_fate("accepted") - handed
    fates = [f for f, _ in wf.generated]  # one per finished episode; raised and None count as dropped, filtered not
    assert totals.groups == len(fates) and totals.groups_dropped == fates.count("failed") + fates.count("group_dropped")


class FailsAfterAnAcceptedRow(EveryFateWorkflow):
    """Rows 0 mod 4 (the failing fate) start generating only once an accepted row has returned."""

    def __init__(self) -> None:
        super().__init__()
        self.returned = threading.Event()

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        while int(data["id"]) % 4 == 0 and not self.returned.is_set():
            await asyncio.sleep(0.002)
        traj = await super().arun_episode(engine, data)
        self.returned.set()
        return traj


def test_results_of_a_rollout_batch_that_gave_up_are_abandoned_not_lost() -> None:
    """Row 3 is accepted before row 0 fails (its episode's completion is handled first on the loop), so
    the failure ends the rollout_batch call with row 3's trajectory collected but never handed out."""
    ex, _ = make_executor(k=0, bsz=2, max_conc=2)
    wf = FailsAfterAnAcceptedRow()
    try:
        with pytest.raises(RuntimeError, match="row 0 failed after generating"):
            ex.rollout_batch([{"id": 3}, {"id": 0}], wf, timeout=30)
        quiesce(ex)
        totals = ex.ledger_totals()
    finally:
        ex.destroy()
    totals.check()
    assert [f for f, _ in wf.generated] == ["accepted", "failed"]
    assert totals.discarded["abandoned"] == wf.by_fate("accepted") and totals.discarded["failed"] == wf.by_fate(
        "failed"
    )
    assert totals.consumed == Tally() and totals.in_flight == Tally()


def test_a_restored_executor_counts_the_checkpoint_in_flight_as_lost_at_restart() -> None:
    ex, _ = make_executor(k=1, bsz=2, max_conc=8, workflow_error_policy="drop")
    wf = EveryFateWorkflow()
    try:
        ex.prepare_batch(make_loader(bsz=2), wf, should_accept_fn=mixed_rewards, timeout=30)
        ex.set_version(5)  # capacity for them
        for pid in (103, 107):  # accepted, and no batch takes them
            ex.submit({"id": pid}, wf)
        wait_until(lambda: {103, 107} <= set(wf.returned_ids), "rows 103 and 107 returned their trajectories")
        quiesce(ex)  # no episode running: both were booked, accepted (no filter), and no batch takes them
        _, state = ex.recover_state()
        before = ex.ledger_totals()
        assert before.in_flight.samples >= 2 * N_SAMPLES, before.in_flight
    finally:
        ex.destroy()
    resumed, _ = make_executor(k=1, bsz=2, max_conc=8)
    try:
        assert resumed.restore_ledger(json.loads(json.dumps(state))) == before.in_flight
        after = resumed.ledger_totals()
    finally:
        resumed.destroy()
    after.check()
    assert after.discarded["lost_at_restart"] == before.in_flight and after.in_flight == Tally()
    assert after.generated == before.generated and after.consumed == before.consumed
    assert (after.groups, after.groups_dropped) == (before.groups, before.groups_dropped) and before.groups_dropped > 0


def test_rlvr_groups_dropped_for_a_failed_reward_are_counted_with_their_tokens(tiny_model_dir: str) -> None:
    """RLVRWorkflow notes its samples before scoring, so a group it drops for a failed reward is in the ledger."""
    from test_workflows import ScriptedEngine, cycle_texts, row

    from tandemrl.configs.rollout import GenerationHyperparameters
    from tandemrl.models.hf import load_hf_tokenizer
    from tandemrl.workflows.rlvr import RLVRWorkflow

    tokenizer = load_hf_tokenizer(tiny_model_dir)

    def reward(answer: str, **_: Any) -> float:
        if answer == "none":
            raise RuntimeError("no reward for this row")
        return 1.0

    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 72"]))
    ex, _ = make_executor(k=0, bsz=2, max_conc=2)
    ex.client = engine
    wf = RLVRWorkflow(reward, GenerationHyperparameters(n_samples=2), tokenizer, stat_scope="test-ledger-rlvr")
    try:  # the dropped row is replaced by the next one round-robin: the good row again
        batch = ex.rollout_batch([row(), row(answer="none")], wf, timeout=30)
        totals = ex.ledger_totals()
    finally:
        ex.destroy()
    totals.check()
    per_sample = len(engine.completion_ids("#### 72"))
    assert totals.discarded["group_dropped"] == Tally(2, 2 * per_sample)
    assert (totals.groups, totals.groups_dropped) == (3, 1)
    assert totals.consumed == _tally(batch) == Tally(4, 4 * per_sample)
