"""WorkflowExecutor driven by an in-process stand-in for the inference transport.

The stand-in engine only replaces the HTTP round trip: it sleeps small random delays and
tags every generated token with the weight version current when it was generated, as
an interruptible server does. The real vLLM client is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.data.loader import collate_as_list
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.utils import stats_tracker
from tandemrl.workflows.rlvr import completion_row

N_SAMPLES = 2


class RandomDelayEngine:
    """agenerate: 1-5 tokens, each after a random delay, tagged with the version at that moment."""

    def __init__(self, seed: int = 0, max_delay: float = 0.003, slow_prob: float = 0.15) -> None:
        self.version = 0
        self.max_delay = max_delay
        self.slow_prob = slow_prob  # some requests are 10x slower, so later rollouts overtake them
        self.rng = random.Random(seed)
        self.gates: dict[int, threading.Event] = {}  # prompt id -> released?
        self.started: list[int] = []

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        pid = req.input_ids[0]
        self.started.append(pid)
        gate = self.gates.get(pid)
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.002)
        tokens, logprobs, versions = [], [], []
        delay = self.max_delay * (10 if self.rng.random() < self.slow_prob else 1)
        for _ in range(self.rng.randint(1, 5)):
            await asyncio.sleep(self.rng.uniform(0, delay))
            tokens.append(self.rng.randrange(10, 100))
            logprobs.append(-self.rng.random())
            versions.append(self.version)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason="stop",
        )


class ToyWorkflow(RolloutWorkflow):
    """N_SAMPLES generations per row; rewards [1, 1] for even ids, [0, 1] for odd ids."""

    def __init__(self, fail_ids: set[int] | None = None) -> None:
        self.fail_ids = fail_ids or set()

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        pid = int(data["id"])
        if pid in self.fail_ids:
            raise ValueError(f"boom on row {pid}")
        prompt = [pid, 7, 8]
        resps = await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=prompt)) for _ in range(N_SAMPLES)])
        rewards = [1.0, 1.0] if pid % 2 == 0 else [0.0, 1.0]
        rows = [completion_row(prompt, r, rew) for r, rew in zip(resps, rewards, strict=True)]
        batch = concat_padded_tensors(rows)
        batch["prompt_id"] = torch.full((N_SAMPLES,), pid)
        return batch


def mixed_rewards(traj: TensorDict) -> bool:
    """DAPO-style dynamic filter: drop groups whose rewards are all equal."""
    return bool(traj["rewards"].min() != traj["rewards"].max())


def make_executor(k: int = 0, bsz: int = 4, max_conc: int | None = None, **cfg: Any) -> tuple[WorkflowExecutor, Any]:
    engine = RandomDelayEngine(seed=k)
    config = InferenceClientConfig(max_head_offpolicyness=k, max_concurrent_rollouts=max_conc, **cfg)
    ex = WorkflowExecutor(config, engine, consumer_batch_size=bsz)
    ex.initialize()
    return ex, engine


def make_loader(n: int = 64, bsz: int = 4, seed: int = 0) -> StatefulDataLoader:
    generator = torch.Generator().manual_seed(seed)
    rows = [{"id": i} for i in range(n)]
    return StatefulDataLoader(rows, batch_size=bsz, shuffle=True, collate_fn=collate_as_list, generator=generator)


def caught_up(ex: WorkflowExecutor) -> None:
    """Block until the executor's loop has run every callback scheduled before this call
    (``submit``'s launch attempt included): the loop runs ``call_soon`` callbacks in order."""
    ran = threading.Event()
    runner = ex._episodes.runner
    assert runner is not None
    runner.call_soon(ran.set)
    assert ran.wait(30)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cond(), f"not in {timeout} s: {what}"


def launched_all_it_may(ex: WorkflowExecutor, consumed: int) -> bool:
    """Nothing running, and no queued row that the current capacity would start."""
    stats = ex.get_stats()
    queued = len(ex.pending_rows()) - stats.running - (stats.accepted - consumed)
    return stats.running == 0 and (queued == 0 or ex.get_capacity() <= 0)


def quiesce(ex: WorkflowExecutor, timeout: float = 10.0) -> None:
    """Pause and let running episodes finish, so counters stop moving."""
    ex.pause()
    deadline = time.monotonic() + timeout
    while ex.get_stats().running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ex.get_stats().running == 0


def row_min_versions(batch: TensorDict) -> list[int]:
    """Oldest weight version among each row's generated tokens."""
    out = []
    for versions, mask in zip(batch["versions"], batch["loss_mask"].bool(), strict=True):
        assert mask.any()
        out.append(int(versions[mask].min()))
    return out


@pytest.mark.parametrize("k", [0, 1, 2])
def test_consumed_samples_are_at_most_k_versions_old(k: int) -> None:
    bsz, steps = 4, 10
    ex, engine = make_executor(k=k, bsz=bsz, max_conc=3 * bsz)
    loader = make_loader(bsz=bsz, seed=k)
    seen = []
    try:
        for step in range(steps):
            trainer_version = engine.get_version()
            batch = ex.prepare_batch(loader, ToyWorkflow(), timeout=30)
            assert batch["rewards"].shape == (bsz * N_SAMPLES,)
            # each trajectory is one prompt's group, kept contiguous
            assert (batch["prompt_id"].view(bsz, N_SAMPLES) == batch["prompt_id"][::N_SAMPLES, None]).all()
            for v in row_min_versions(batch):
                lag = trainer_version - v
                assert 0 <= lag <= k, f"sample of version {v} consumed at version {trainer_version} (k={k})"
                seen.append(lag)
            if k == 0:
                generated = batch["versions"][batch["loss_mask"].bool()]
                assert (generated == trainer_version).all()
            # "training": rollouts for the next steps start at this version and finish
            caught_up(ex)
            wait_until(
                functools.partial(launched_all_it_may, ex, (step + 1) * bsz), "rollouts started at this version finish"
            )
            ex.pause()
            ex.set_version(trainer_version + 1)  # weight update
            ex.resume()
        stats = ex.get_stats()
        assert stats.submitted == stats.accepted + stats.rejected + stats.running
        assert stats.accepted >= steps * bsz
    finally:
        ex.destroy()
    if k > 0:
        assert max(seen) >= 1, "rollouts never ran ahead of the trainer: the test exercised nothing asynchronous"


def test_wait_holds_back_a_batch_for_an_older_running_rollout() -> None:
    """k=2, B=1: after consuming a newer sample at v1, two v0 samples remain due by v2.

    Handing out another newer sample at v1 would make one of them 3 versions stale, so
    wait() must wait for an old one instead.
    """
    ex, engine = make_executor(k=2, bsz=1, max_conc=8)
    wf = ToyWorkflow()
    try:
        for pid in (1, 3, 5, 7):
            engine.gates[pid] = threading.Event()
        for pid in (1, 3, 5):  # capacity at v0 is (2 + 0 + 1) * 1 = 3
            ex.submit({"id": pid}, wf)
        engine.gates[5].set()
        first = ex.wait(1, timeout=10)
        assert int(first["prompt_id"][0]) == 5
        ex.set_version(1)
        ex.submit({"id": 7}, wf)  # capacity (2 + 1 + 1) - 3 = 1: starts at v1
        engine.gates[7].set()
        deadline = time.monotonic() + 10
        while ex.get_stats().accepted < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.get_stats().accepted == 2  # row 7 is ready...
        with pytest.raises(TimeoutError, match="timed out"):
            ex.wait(1, timeout=0.3)  # ...but must not be handed out before a v0 row
        engine.gates[1].set()
        second = ex.wait(1, timeout=10)
        assert int(second["prompt_id"][0]) == 1
    finally:
        for gate in engine.gates.values():
            gate.set()
        ex.destroy()


def test_filtering_keeps_batch_size_and_reports_rejections() -> None:
    bsz = 4
    ex, _ = make_executor(k=1, bsz=bsz, max_conc=8)
    loader = make_loader(bsz=bsz)
    try:
        for step in range(4):
            batch = ex.prepare_batch(loader, ToyWorkflow(), should_accept_fn=mixed_rewards, timeout=30)
            assert batch["rewards"].shape == (bsz * N_SAMPLES,)
            assert (batch["prompt_id"] % 2 == 1).all(), "an all-equal-reward group got through"
            ex.set_version(step + 1)
        quiesce(ex)
        stats = ex.get_stats()
        assert stats.rejected > 0
        assert stats.submitted == stats.accepted + stats.rejected + stats.running
        exported = ex.export_stats()
        assert exported["rollout/rejected"] == stats.rejected
        assert exported["rollout/accepted"] == stats.accepted
        assert "rollout/staleness/max" in exported
    finally:
        ex.destroy()


def test_unset_concurrency_runs_all_the_staleness_bound_allows() -> None:
    """max_concurrent_rollouts unset, k = 1, batch 2: (1 + 1) x 2 = 4 episodes run at once (the next batch is
    generated while the trainer trains), and no fifth starts."""
    ex, engine = make_executor(k=1, bsz=2)
    try:
        for pid in range(6):
            engine.gates[pid] = threading.Event()
            ex.submit({"id": pid}, ToyWorkflow())
        wait_until(lambda: ex.get_stats().running == 4, "4 episodes running")
        caught_up(ex)
        assert ex.get_stats().running == 4 and ex.get_capacity() == 0
        assert ex.max_concurrent_rollouts == 4
    finally:
        for gate in engine.gates.values():
            gate.set()
        ex.destroy()


class RecordingWorkflow(ToyWorkflow):
    """ToyWorkflow that records its row's id as the scalar ``rollout/episode_id``."""

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        stats_tracker.get("rollout").scalar(episode_id=float(data["id"]))
        return await super().arun_episode(engine, data)


def test_an_episodes_scalars_are_recorded_when_the_trainer_takes_it() -> None:
    """The scalars a workflow records are exported with the step that consumes its episode (so every step of
    an async run has rollout/reward, describing its own batch); a filtered-out episode's are exported at once,
    under rollout/filtered/, so rollout/* describes only the samples trained on."""
    ex, _ = make_executor(k=2, bsz=1, max_conc=8)
    try:
        for pid in (1, 2, 3):  # odd ids have mixed rewards and are accepted; 2 is rejected
            ex.submit({"id": pid}, RecordingWorkflow(), should_accept_fn=mixed_rewards)
        wait_until(lambda: ex.get_stats().accepted == 2 and ex.get_stats().rejected == 1, "3 episodes done")
        early = ex.export_stats()
        assert (early["rollout/filtered/episode_id"], early["rollout/filtered/episode_id__count"]) == (2.0, 1.0)
        assert "rollout/episode_id" not in early, early
        for _ in range(2):
            pid = int(ex.wait(1, timeout=10)["prompt_id"][0])
            step = ex.export_stats()
            assert (step["rollout/episode_id"], step["rollout/episode_id__count"]) == (float(pid), 1.0), step
        assert "rollout/episode_id" not in ex.export_stats()
    finally:
        ex.destroy()


def test_rollout_batch_replaces_rejected_rows_and_keeps_size() -> None:
    ex, _ = make_executor(k=0, bsz=4, max_conc=4)
    try:
        data = [{"id": i} for i in (1, 2, 3, 4)]
        batch = ex.rollout_batch(data, ToyWorkflow(), should_accept_fn=mixed_rewards, timeout=30)
        assert batch["rewards"].shape == (4 * N_SAMPLES,)
        assert (batch["prompt_id"] % 2 == 1).all()
        assert ex.get_stats().rejected >= 2
        # no filter: results follow the order of the data
        ex.set_version(1)
        plain = ex.rollout_batch(data, ToyWorkflow(), timeout=30)
        assert plain["prompt_id"][::N_SAMPLES].tolist() == [1, 2, 3, 4]
    finally:
        ex.destroy()


def test_rollout_batch_replaces_rejected_rows_with_refill_rows() -> None:
    """DAPO's dynamic sampling in a synchronous step: rejected groups are replaced by new prompts from
    ``refill`` in its order, never by another group of a rejected prompt, and the refill rows not needed
    stay unread."""
    ex, _ = make_executor(k=0, bsz=2, max_conc=1)
    try:
        refill = iter([{"id": i} for i in (4, 5, 7, 9, 11)])
        batch = ex.rollout_batch([{"id": 2}, {"id": 3}], ToyWorkflow(), should_accept_fn=mixed_rewards, refill=refill)
        assert batch["prompt_id"][::N_SAMPLES].tolist() == [3, 5]
        assert [row["id"] for row in refill] == [7, 9, 11]
    finally:
        ex.destroy()


def test_rollout_batch_gives_up_when_everything_is_rejected() -> None:
    ex, _ = make_executor(k=0, bsz=2, max_conc=2)
    try:
        with pytest.raises(RuntimeError, match="rejected"):
            ex.rollout_batch([{"id": 0}, {"id": 2}], ToyWorkflow(), should_accept_fn=mixed_rewards, max_rounds=2)
        assert ex.get_stats().rejected >= 4
    finally:
        ex.destroy()


def test_workflow_error_surfaces_on_next_wait_and_runner_survives() -> None:
    ex, _ = make_executor(k=0, bsz=1, max_conc=4)
    wf = ToyWorkflow(fail_ids={3})
    try:
        ex.submit({"id": 3}, wf)
        with pytest.raises(RuntimeError, match="boom on row 3") as info:
            ex.wait(1, timeout=10)
        assert isinstance(info.value.__cause__, ValueError)
        assert ex.n_failed == 1
        ex.submit({"id": 5}, wf)  # the runner thread is still alive and serving
        batch = ex.wait(1, timeout=10)
        assert int(batch["prompt_id"][0]) == 5
    finally:
        ex.destroy()


def test_drop_policy_skips_failed_rollouts() -> None:
    bsz = 2
    ex, _ = make_executor(k=1, bsz=bsz, max_conc=4, workflow_error_policy="drop")
    try:
        loader = make_loader(n=8, bsz=bsz)
        for step in range(3):
            batch = ex.prepare_batch(loader, ToyWorkflow(fail_ids={0, 1, 2}), timeout=30)
            assert batch["rewards"].shape == (bsz * N_SAMPLES,)
            assert not set(batch["prompt_id"].tolist()) & {0, 1, 2}
            ex.set_version(step + 1)
        quiesce(ex)
        assert ex.n_failed > 0
        assert ex.export_stats()["rollout/failed"] == ex.n_failed
    finally:
        ex.destroy()


def test_invalid_error_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="workflow_error_policy"):
        WorkflowExecutor(InferenceClientConfig(workflow_error_policy="ignore"), RandomDelayEngine())


def test_workflow_returning_junk_is_a_clear_error() -> None:
    class Junk(RolloutWorkflow):
        async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> Any:
            return [1, 2, 3]

    ex, _ = make_executor()
    try:
        ex.submit({"id": 1}, Junk())
        with pytest.raises(RuntimeError, match="Junk.arun_episode returned list"):
            ex.wait(1, timeout=10)
    finally:
        ex.destroy()


def test_pause_stops_new_episodes_and_resume_restarts_them() -> None:
    ex, engine = make_executor(k=0, bsz=2, max_conc=2)
    try:
        ex.pause()
        ex.submit({"id": 1}, ToyWorkflow())
        ex.submit({"id": 2}, ToyWorkflow())
        caught_up(ex)  # the launch attempts of both submits have run
        assert ex.get_stats().submitted == 0 and engine.started == []
        with pytest.raises(TimeoutError, match=r"paused True"):
            ex.wait(2, timeout=0.1)
        ex.resume()
        batch = ex.wait(2, timeout=10)
        assert sorted(batch["prompt_id"][::N_SAMPLES].tolist()) == [1, 2]
    finally:
        ex.destroy()


def test_pause_lets_running_episodes_finish() -> None:
    ex, engine = make_executor(k=0, bsz=1, max_conc=1)
    try:
        engine.gates[4] = threading.Event()
        ex.submit({"id": 4}, ToyWorkflow())
        wait_until(
            lambda: ex.get_stats().running == 1 and engine.started == [4, 4], "row 4 running, both samples at the gate"
        )
        ex.pause()
        engine.gates[4].set()
        batch = ex.wait(1, timeout=10)
        assert int(batch["prompt_id"][0]) == 4
    finally:
        ex.destroy()


def test_destroy_stops_the_thread_with_episodes_running() -> None:
    ex, engine = make_executor(k=0, bsz=2, max_conc=2)
    engine.gates[1] = threading.Event()  # never released
    ex.submit({"id": 1}, ToyWorkflow())
    wait_until(lambda: engine.started == [1, 1], "both samples of row 1 wait at the gate")
    runner = ex._episodes.runner
    assert runner is not None
    ex.destroy()  # returns although the gate is never released: it cancels the episode
    assert not runner.is_alive()
    with pytest.raises(RuntimeError, match="initialize"):
        ex.submit({"id": 2}, ToyWorkflow())


def test_submit_before_initialize_is_a_clear_error() -> None:
    ex = WorkflowExecutor(InferenceClientConfig(), RandomDelayEngine())
    with pytest.raises(RuntimeError, match="initialize"):
        ex.submit({"id": 0}, ToyWorkflow())


def test_batches_the_staleness_bound_cannot_supply_are_rejected_up_front() -> None:
    ex, _ = make_executor(k=1, bsz=2, max_conc=2)
    try:
        with pytest.raises(ValueError, match=r"consumer_batch_size=2 with max_head_offpolicyness=1 lets at most 4"):
            ex.wait(5, timeout=1)
        with pytest.raises(ValueError, match="rollout_batch: needs 5 trajectories"):
            ex.rollout_batch([{"id": i} for i in range(5)], ToyWorkflow())
        with pytest.raises(ValueError, match="prepare_batch: needs 8"):
            ex.prepare_batch(make_loader(bsz=8), ToyWorkflow())
    finally:
        ex.destroy()


def test_submit_beyond_queue_size_is_a_clear_error() -> None:
    ex, _ = make_executor(k=0, bsz=1, queue_size=2)
    try:
        ex.pause()
        ex.submit({"id": 1}, ToyWorkflow())
        ex.submit({"id": 2}, ToyWorkflow())
        with pytest.raises(queue.Full, match="queue_size"):
            ex.submit({"id": 3}, ToyWorkflow())
    finally:
        ex.destroy()


def test_async_batches_that_reject_everything_give_up_in_one_line() -> None:
    """prepare_batch with max_rounds: when every group is rejected, the call fails once more than max_rounds
    batches' worth were rejected, in one line naming them and dynamic_sampling_rounds (it used to wait forever)."""
    ex, _ = make_executor(k=1)
    try:
        loader = make_loader()
        with pytest.raises(RuntimeError) as err:
            ex.prepare_batch(loader, ToyWorkflow(), should_accept_fn=lambda traj: False, timeout=60, max_rounds=2)
        msg = str(err.value)
        assert "\n" not in msg and "no batch of 4 filled; gave up after 2 rounds of rejections" in msg, msg
        rejected = int(msg.split("prepare_batch: ")[1].split()[0])
        assert rejected > 8 and ex.get_stats().accepted == 0 and "actor.dynamic_sampling_rounds" in msg, msg
    finally:
        ex.destroy()


def test_a_give_up_names_the_groups_dropped_not_only_the_filter() -> None:
    """Episodes of the wrong size (actor.group_size != the samples per prompt) drop their groups; when a
    synchronous batch gives up before the failure budget is spent, its line names that cause (it blamed only
    should_accept_fn and dynamic_sampling_rounds)."""
    from tandemrl.rollout.whole_groups import WholeGroups

    ex, _ = make_executor(k=0, max_consecutive_drops=100, max_dropped_share=1.0)
    try:
        with pytest.raises(RuntimeError) as err:
            ex.rollout_batch(
                [{"id": i} for i in range(4)], WholeGroups(ToyWorkflow(), rows=4), timeout=60, max_rounds=1
            )
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("rollout_batch: ") and "gave up after 1 extra rounds" in msg, msg
        assert f"ToyWorkflow returned {N_SAMPLES} rows for one prompt; the trainer's groups need 4" in msg, msg
    finally:
        ex.destroy()
