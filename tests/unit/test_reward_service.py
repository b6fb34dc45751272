"""Rewards from an HTTP service (``tandemrl.inference.reward_service``) and the auxiliary-server contract.

The reward service is a real aiohttp server in this process (its own event-loop thread); generation
goes through the scripted engine of test_workflows (a stand-in for the inference transport only)
and the real ``WorkflowExecutor``. Requests that must time out wait on an event that is set only at
teardown, so they always time out, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from test_workflows import ScriptedEngine, cycle_texts, row

from tandemrl.api.aux_servers import AUX_SERVERS_ENV, aux_server_addresses, format_aux_addresses
from tandemrl.configs import GRPOConfig
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.loader import ConfigError
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.configs.services import RewardServiceConfig
from tandemrl.inference.reward_service import RemoteReward
from tandemrl.launchers.common import refuse_local_only
from tandemrl.launchers.dry_run import allocation_lines
from tandemrl.launchers.launch_config import read_launch_spec
from tandemrl.launchers.placement import plan_placement
from tandemrl.models.hf import load_hf_tokenizer
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.trainers.entry import load_config
from tandemrl.utils import stats_tracker
from tandemrl.workflows.rlvr import RLVRWorkflow

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class RewardServer:
    """A reward service on 127.0.0.1: behaviour chosen by the row's ``question``.

    ``hang``: never replies (until stop); ``flaky``: HTTP 503 on its first request, then rewards; ``bad``: HTTP 400; ``hold``: waits for ``release`` (to see how many are in flight);
    anything else: reward 1.0 when the completion contains the reference's final number.
    """

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen_auth: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{self.port}/reward"
        self.arrived = threading.Condition()

    async def _start(self) -> int:
        from aiohttp import web

        self.stopping = asyncio.Event()
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/reward", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        question = body["question"]
        self.seen_auth.append(request.headers.get("Authorization"))
        with self.arrived:
            self.hits[question] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.arrived.notify_all()
        try:
            if question == "hang":
                await self.stopping.wait()
            if question == "hold":
                await self.release.wait()
            if question == "bad":
                return web.json_response({"error": "no such task"}, status=400)
            if question == "flaky" and self.hits[question] == 1:
                return web.json_response({"error": "busy"}, status=503)
            final = body["answer"].split("####")[-1].strip()
            return web.json_response({"reward": 1.0 if final in body["completion"] else 0.0})
        finally:
            with self.arrived:
                self.in_flight -= 1

    def wait_for(self, predicate: Any, timeout: float = 60.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(predicate, timeout=timeout), "the reward server never saw the requests"

    def stop(self) -> None:
        async def shutdown() -> None:
            self.stopping.set()
            self.release.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture
def server() -> Iterator[RewardServer]:
    s = RewardServer()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    return load_hf_tokenizer(tiny_model_dir)


def test_timeouts_are_retried_then_drop_the_group_and_the_batch_goes_on(server: RewardServer, tokenizer: Any) -> None:
    # the timeout only needs to end the "hang" requests: 2 s leaves the others room on a loaded machine (0.5 s flaked)
    cfg = RewardServiceConfig(url=server.url, timeout=2.0, retries=2, backoff=0.01, max_concurrency=8)
    reward = RemoteReward(cfg, stat_scope="svc")
    engine = ScriptedEngine(tokenizer, cycle_texts(["so #### 72"]))
    ex = WorkflowExecutor(InferenceClientConfig(max_head_offpolicyness=0), engine, consumer_batch_size=3)
    ex.initialize()
    rows = [row("ok", "#### 72"), row("hang", "#### 72"), row("flaky", "#### 72")]
    try:
        wf = RLVRWorkflow(reward, GenerationHyperparameters(n_samples=2), tokenizer, stat_scope="svc")
        batch = ex.rollout_batch(rows, wf, timeout=120, max_rounds=2)
    finally:
        ex.destroy()
        reward.close()
    # the hanging group is gone and "ok" refilled its place; the flaky group made it after one retry
    assert batch["rewards"].tolist() == [1.0] * 6
    assert server.hits["hang"] == 2 * 3  # 2 samples x (1 attempt + 2 retries), then dropped
    assert server.hits["flaky"] == 2 + 1 and server.hits["ok"] == 2 * 2
    stats = stats_tracker.get("svc").export()
    calls = stats["svc/reward_service/failed__count"]
    assert calls == 8  # 2 ok x2 rows, 2 flaky, 2 hang
    assert stats["svc/reward_service/failed"] * calls == 2  # both hanging samples, after their retries
    assert stats["svc/reward_service/retries"] * calls == 2 * 2 + 1  # hang: 2 each; flaky: 1
    assert stats["svc/group_dropped"] * stats["svc/group_dropped__count"] == 1
    assert stats["svc/reward_failed"] * stats["svc/reward_failed__count"] == 2
    assert set(server.seen_auth) == {None}  # the run's server token never goes to a reward URL


def test_a_4xx_reply_fails_at_once_without_retries(server: RewardServer, tokenizer: Any) -> None:
    reward = RemoteReward(RewardServiceConfig(url=server.url, timeout=30, retries=3), stat_scope="svc4")
    wf = RLVRWorkflow(reward, GenerationHyperparameters(n_samples=2), tokenizer, stat_scope="svc4")
    try:
        assert asyncio.run(wf.arun_episode(ScriptedEngine(tokenizer, cycle_texts(["#### 1"])), row("bad"))) is None
    finally:
        reward.close()
    assert server.hits["bad"] == 2
    assert wf.reward.n_errors == 2 and list(wf.reward.failures) == ["raised RewardServiceError"]


def test_concurrency_is_capped(server: RewardServer) -> None:
    reward = RemoteReward(RewardServiceConfig(url=server.url, timeout=60, max_concurrency=2), stat_scope="svccap")

    async def many() -> list[float]:
        return await asyncio.gather(
            *[reward(prompt="p", completions=f"#### {i}", question="hold", answer="#### 0") for i in range(12)]
        )

    result: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: result.update(out=asyncio.run(many())), daemon=True)
    caller.start()
    try:
        server.wait_for(lambda: server.in_flight == 2)
        asyncio.run_coroutine_threadsafe(_set(server.release), server.loop).result(timeout=30)
        caller.join(timeout=120)
    finally:
        reward.close()
    assert len(result["out"]) == 12
    assert server.hits["hold"] == 12 and server.max_in_flight == 2


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_aux_server_addresses_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUX_SERVERS_ENV, format_aux_addresses({"judge": ["127.0.0.1:1", "127.0.0.1:2"]}))
    assert aux_server_addresses("judge") == ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(LookupError, match=r"no auxiliary server 'teacher'.*\['judge'\].*vllm\[teacher\]"):
        aux_server_addresses("teacher")
    monkeypatch.delenv(AUX_SERVERS_ENV)
    with pytest.raises(LookupError, match="'judge'"):
        aux_server_addresses("judge")


def test_allocation_names_gen_and_aux_servers() -> None:
    alloc = parse_allocation("vllm[judge]:d2+vllm[gen]:d1+fsdp[actor]:d1")
    assert alloc.gen is not None and alloc.gen.name == "gen"
    assert [c.name for c in alloc.aux] == ["judge"]
    assert parse_allocation("vllm:d1+fsdp:d1").aux == []
    cpu = plan_placement(alloc, [], [0, 1])
    assert cpu.aux_env == {"judge": [{}, {}]}  # CPU: vLLM's own binding, cores shared
    gpu = plan_placement(alloc, [str(i) for i in range(4)], [0])
    assert gpu.server_env == [{"CUDA_VISIBLE_DEVICES": "0"}] and gpu.trainer_env["CUDA_VISIBLE_DEVICES"] == "1"
    assert gpu.aux_env == {"judge": [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]}
    with pytest.raises(ValueError, match="needs 4 GPUs with its auxiliary servers but 3"):
        plan_placement(alloc, ["0", "1", "2"], [0])


JUDGE = ["allocation_mode='vllm[gen]:d1+vllm[judge]:d1+fsdp[actor]:d1'", "+aux_servers.judge.path=tiny:qwen2"]


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["reward_service.judge=judge"], "reward_service.judge", "no auxiliary server of allocation_mode"),
        ([JUDGE[0]], "aux_servers.judge.path", "is not set"),
        ([*JUDGE, "reward_service.judge=teacher"], "reward_service.judge", "add 'vllm[teacher]:d1'"),
        (["reward_service.url=localhost:8000/r"], "reward_service.url", "expected http://host:port/path"),
        (["reward_service.url=http://h:port/r"], "reward_service.url", "not a URL"),
        ([*JUDGE, "reward_service.judge=judge", "reward_service.url=http://h:1/r"], "reward_service.judge", "only one"),
        (["+aux_servers.teacher.path=tiny:qwen2"], "aux_servers.teacher", "names no auxiliary server"),
        (
            ["allocation_mode='vllm[gen]:d1+vllm[judge]:d1|fsdp[actor]:d1'", JUDGE[1]],
            "allocation_mode",
            "colocates auxiliary server 'judge'",
        ),
    ],
)
def test_service_config_errors_are_one_line_naming_the_key(overrides: list[str], key: str, says: str) -> None:
    argv = ["--config", "examples/gsm8k_grpo.yaml", *overrides]
    with pytest.raises(ConfigError) as err:
        load_config(argv, GRPOConfig)
    text = str(err.value)
    assert "\n" not in text and f"'{key}'" in text and says in text
    with pytest.raises(ValueError) as launch_err:  # the launcher's own reading says the same, before any start
        read_launch_spec("examples/gsm8k_grpo.yaml", overrides)
    assert f"'{key}'" in str(launch_err.value) and says in str(launch_err.value)


def test_ray_and_slurm_refuse_aux_servers_and_running_servers_before_any_start() -> None:
    specs = [([], read_launch_spec("examples/gsm8k_grpo.yaml", JUDGE))]
    with pytest.raises(ValueError, match=r"auxiliary servers \(judge\) are started by the local launcher only"):
        refuse_local_only(specs, "ray")
    running = [([], read_launch_spec("examples/gsm8k_grpo.yaml", ["rollout.server_addrs=[127.0.0.1:1]"]))]
    with pytest.raises(ValueError, match=r"^rollout.server_addrs: running servers are used by the local launcher only"):
        refuse_local_only(running, "slurm")
    refuse_local_only([([], read_launch_spec("examples/gsm8k_grpo.yaml", []))], "slurm")  # neither: fine
    assert "auxiliary server judge: 1 vllm, 1 devices each" in allocation_lines(specs[0][1].allocation)


def test_launcher_reads_aux_servers() -> None:
    spec = read_launch_spec("examples/gsm8k_grpo.yaml", [*JUDGE, "+aux_servers.judge.server_args.max_model_len=512"])
    assert [(a.name, a.model_path, a.server_args) for a in spec.aux_servers] == [
        ("judge", "tiny:qwen2", {"max_model_len": 512})
    ]


def test_a_dead_auxiliary_server_stops_the_run_with_one_line() -> None:
    from test_faults_runtime import _Sleeper

    from tandemrl.launchers.server_watch import wait_trainer

    trainer, gen, judge = _Sleeper("trainer"), _Sleeper("127.0.0.1:1001"), _Sleeper("127.0.0.1:1002")
    stopped: list[int] = []
    try:
        judge.proc.kill()
        rc, error = wait_trainer(
            trainer.proc, [gen], "vllm", True, lambda: (stopped.append(1), trainer.proc.kill()), [("judge", judge)]
        )
    finally:
        for p in (trainer, gen, judge):
            p.proc.kill()
            p.proc.wait()
    assert rc == 1 and stopped == [1]
    assert error == "auxiliary server judge at 127.0.0.1:1002 was killed by SIGKILL: the run needs it"


def test_a_mistyped_aux_server_key_names_the_valid_ones(tmp_path: Any) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("aux_servers:\n  judge:\n    pth: tiny:qwen2\n")
    for argv in (["+aux_servers.judge.pth=x"], ["--config", str(bad)]):
        with pytest.raises(ConfigError, match=r"'aux_servers\.judge\.pth'.*did you mean 'aux_servers\.judge\.path'"):
            load_config(argv, GRPOConfig)
