"""Colocated placement ('|'): servers and trainer take turns on the same devices.

Placement plans (devices, threads, server flags) are pure; sleep/wake runs against the session's
real vLLM server; GRPO runs 2 steps through the real local launcher, and the servers' own request
log proves no generation ran during the trainer's turns.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_launcher import _grpo_args, _run

from tandemrl.api.inference import HttpRequest, ModelRequest, ModelResponse
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.http import HttpClient
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.inference.request_log import read_request_log
from tandemrl.inference.sglang import SGLangBackend
from tandemrl.inference.vllm import VLLMBackend
from tandemrl.launchers.placement import RankSlot, oversubscription, plan_colocated, plan_placement
from tandemrl.trainers.turns import TURNS_FILE

GENERATE = "/inference/v1/generate"


# ---------------------------------------------------------------- placement plans (pure)
def test_cpu_disaggregated_keeps_one_thread_per_rank_and_vllm_binding() -> None:
    plan = plan_placement(parse_allocation("vllm:d1+fsdp:d2"), [], [0, 1, 2, 3])
    assert not plan.colocated
    assert plan.server_env == [{}] and plan.server_flags == {}
    assert plan.trainer_env == {"OMP_NUM_THREADS": "1"}


def test_more_cpu_devices_than_cores_is_one_warning() -> None:
    """4 devices apart (1 server + 3 trainer ranks) on 2 cores: a warning naming both counts; none when they
    fit, on GPUs, or colocated (the sides take turns on the same cores by design)."""
    crowded = oversubscription(parse_allocation("vllm:d1+fsdp:d3"), [], [0, 1])
    assert crowded is not None and "\n" not in crowded
    assert crowded.startswith("allocation_mode 'vllm:d1+fsdp:d3' places 4 CPU devices (one process each) on 2 cores")
    assert oversubscription(parse_allocation("vllm:d1+fsdp:d1"), [], [0, 1]) is None
    assert oversubscription(parse_allocation("vllm:d1+fsdp:d3"), ["0", "1", "2", "3"], [0, 1]) is None
    assert oversubscription(parse_allocation("vllm:d2|fsdp:d2"), [], [0, 1]) is None


@pytest.mark.parametrize(
    ("mode", "cpus", "binds", "threads"),
    [
        ("vllm:d1|fsdp:d1", [0, 1], ["0,1"], "2"),
        ("vllm:d1|fsdp:d2", [0, 1, 2, 3], ["0,1,2,3"], "2"),
        ("vllm:d2|fsdp:d1", [4, 5, 6, 7], ["4,5", "6,7"], "4"),
        ("vllm:d1t2|fsdp:d1", [0, 1, 2, 3], ["0,1|2,3"], "4"),
        ("vllm:d2|fsdp:d2", [0], ["0", "0"], "1"),  # fewer cores than ranks: shared, never 0 threads
    ],
)
def test_cpu_colocated_gives_each_side_every_core(mode: str, cpus: list[int], binds: list[str], threads: str) -> None:
    plan = plan_placement(parse_allocation(mode), [], cpus)
    assert plan.colocated
    assert [env["VLLM_CPU_OMP_THREADS_BIND"] for env in plan.server_env] == binds
    assert plan.trainer_env == {"OMP_NUM_THREADS": threads}


def test_gpu_placements_split_or_share_the_visible_devices() -> None:
    gpus = ["3", "5", "6", "7"]
    apart = plan_placement(parse_allocation("vllm:d1t2+fsdp:d2"), gpus, [0])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in apart.server_env] == ["3,5"]
    assert apart.trainer_env["CUDA_VISIBLE_DEVICES"] == "6,7" and apart.server_flags == {}
    shared = plan_placement(parse_allocation("vllm:d2|fsdp:d2"), gpus, [0])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in shared.server_env] == ["3", "5"]
    assert shared.trainer_env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert shared.server_flags["enable_sleep_mode"] is True and 0 < shared.server_flags["gpu_memory_utilization"] < 1
    with pytest.raises(ValueError, match=r"needs 4 GPUs \(disaggregated\) but 2 are visible"):
        plan_placement(parse_allocation("vllm:d2+fsdp:d2"), ["0", "1"], [0])


def test_colocated_over_nodes_gives_each_server_its_ranks_devices() -> None:
    """Ray/Slurm: server i shares ranks i*tp*pp.. on their node; each node gets the one-machine plan."""
    ranks = [RankSlot("a", [g], []) for g in ("4", "5", "6", "7")] + [RankSlot("b", [str(g)], []) for g in range(4)]
    plan = plan_colocated(parse_allocation("vllm:d4t2|fsdp:d8"), ranks)
    assert [(s.ranks, s.node, s.env["CUDA_VISIBLE_DEVICES"]) for s in plan.servers] == [
        ([0, 1], "a", "4,5"),
        ([2, 3], "a", "6,7"),
        ([4, 5], "b", "0,1"),
        ([6, 7], "b", "2,3"),
    ]
    assert plan.server_flags["enable_sleep_mode"] is True
    assert (
        plan.trainer_env["a"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and plan.trainer_env["b"]["OMP_NUM_THREADS"] == "1"
    )
    # CPU, one server for two nodes' ranks: it binds its node's cores; every rank splits its node's cores.
    cpu = [RankSlot(n, [], [0, 1, 2, 3]) for n in ("a", "a", "b", "b")]
    plan = plan_colocated(parse_allocation("vllm:d1|fsdp:d4"), cpu)
    assert [(s.ranks, s.node, s.env) for s in plan.servers] == [([0], "a", {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3"})]
    assert plan.trainer_env == {"a": {"OMP_NUM_THREADS": "2"}, "b": {"OMP_NUM_THREADS": "2"}}
    assert plan.server_flags == {}


def test_colocated_over_nodes_refuses_servers_without_whole_ranks() -> None:
    with pytest.raises(ValueError, match=r"'vllm:d3\|fsdp:d2': 3 server devices but 2 trainer ranks"):
        plan_colocated(parse_allocation("vllm:d3|fsdp:d2"), [RankSlot("a")] * 2)
    three_and_three = [RankSlot(n, [str(i % 3)]) for i, n in enumerate("aaabbb")]
    with pytest.raises(ValueError, match=r"server 1 \(tp\*pp=2\) would share trainer ranks 2-3, which are not 2"):
        plan_colocated(parse_allocation("vllm:d2t2|fsdp:d6"), three_and_three)


def test_sleep_and_wake_requests_per_backend() -> None:
    vllm, sglang = VLLMBackend(), SGLangBackend()
    assert (vllm.build_sleep(1).method, vllm.build_sleep(1).path) == ("POST", "/sleep?level=1&mode=abort")
    assert vllm.build_wake_up().path == "/wake_up"
    assert sglang.build_sleep(1).path == "/release_memory_occupation"
    assert sglang.build_wake_up().path == "/resume_memory_occupation"


# ---------------------------------------------------------------- real vLLM server
class PathsClient(HttpClient):
    """The real client, remembering each request's path."""

    def __init__(self) -> None:
        super().__init__("paths-client")
        self.paths: list[str] = []

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        self.paths.append(req.path)
        return await super().send(addr, req, *args, **kwargs)


@pytest.mark.slow
def test_sleep_holds_generation_until_wake_up_on_real_vllm(vllm_server) -> None:
    """Level 1 (the GPU level; a CPU worker keeps its memory) aborts the running request, the server
    reports it is sleeping, and after wake_up the request finishes with its full length."""
    client = PathsClient()
    engine = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(setup_timeout=60), http_client=client)
    engine.initialize([vllm_server.proc.address])
    n, prompt = 32, [9, 31, 77, 5, 120, 64]
    req = ModelRequest(input_ids=list(prompt), metadata={"ignore_eos": True})
    req.gconfig.greedy, req.gconfig.max_new_tokens = True, n
    is_sleeping = HttpRequest("GET", "/is_sleeping", None, 60.0)
    try:

        async def run() -> ModelResponse:
            with vllm_server.gate(prompt) as gate:
                task = asyncio.ensure_future(engine.agenerate(req))
                held = await asyncio.to_thread(gate.wait_held)
                await asyncio.to_thread(gate.release_until, lambda: engine.sleep(1), held, n - 1)
                # The engine stepped once more, when the pause reached its input queue, and then aborted.
                assert gate.granted == 1, gate.granted
            assert vllm_server.call(is_sleeping)["is_sleeping"] is True
            assert not task.done()  # aborted; waits for wake_up to resubmit
            await asyncio.to_thread(engine.wake_up)
            return await task

        resp = asyncio.run(run())
        assert vllm_server.call(is_sleeping)["is_sleeping"] is False
        assert resp.output_len == n and resp.stop_reason == "length"
        sleep_wake = ["/pause?mode=abort", "/sleep?level=1&mode=abort", "/wake_up"]
        assert client.paths[:5] == ["/health", GENERATE, *sleep_wake], client.paths
        # wake_up lifts the pause before it sends /resume: the resubmission and /resume race (vLLM holds a
        # generate until /resume), so either is sent first; both only after /wake_up returned.
        assert sorted(client.paths[5:]) == sorted([GENERATE, "/resume"]), client.paths
        with pytest.raises(RuntimeError, match="not put to sleep"):
            engine.wake_up()
    finally:
        engine.destroy()
        client.close()


# ---------------------------------------------------------------- GRPO through the launcher
def _arrived_during(request: dict, turn: dict) -> bool:
    return turn["start"] < request["start"] <= turn["end"]


def assert_no_generation_during_turns(run: Path, steps: int) -> None:
    """``run``'s turns.jsonl against vllm-server-0's request log: every turn had the server paused
    and generating nothing, rollouts and the final evaluation were served, and the server bound
    every core of this machine (vLLM alone would hold one back for its front end)."""
    turns = [json.loads(line) for line in (run / TURNS_FILE).read_text().splitlines()]
    assert [t["turn"] for t in turns] == list(range(1, steps + 1))
    requests = read_request_log(str(run / "vllm-server-0-requests.jsonl"))
    generates = [r for r in requests if r["path"] == GENERATE]
    # Training rollouts (8 prompts x 4 samples per step) and the final evaluation were served.
    assert len(generates) >= steps * 32 + 8 and all(r["status"] == 200 for r in generates)
    # Only the servers' arrival times are compared with the turn: a request arrives before its answer
    # leaves, so the trainer (which starts a turn after the pause's answer, and sends the wake-up after
    # the turn ends) orders them by causality. The log's "end" is taken after the answer was sent and
    # may come a few ms after the trainer has already started its turn.
    control = [r for r in requests if r["path"] in ("/pause", "/resume")]
    for turn in turns:
        assert not [g for g in generates if _arrived_during(g, turn)], turn
        # The last control request to reach the server before the turn paused it; none resumed it in the turn.
        before = [r for r in control if r["start"] <= turn["start"]]
        assert before and before[-1]["path"] == "/pause", turn
        assert not [r for r in control if r["path"] == "/resume" and _arrived_during(r, turn)], turn
    cpus = sorted(os.sched_getaffinity(0))
    server_log = (run / "vllm-server-0.log").read_text()
    assert f"core ids={cpus}" in server_log or len(cpus) < 2, server_log[-2000:]


@pytest.mark.slow
def test_colocated_grpo_never_generates_during_training(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    steps = 2
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=steps, new_tokens=16)
    # The user's server flags (launcher.server_args) reach the server's command line.
    server_args = ["launcher.server_args.max_num_seqs=48"]
    proc = _run([*args, "allocation_mode=vllm:d1|fsdp:d2", "async_training=false", *server_args], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    assert_no_generation_during_turns(run, steps)
    command = json.loads((run / "vllm-server-0.log").read_text().splitlines()[0].removeprefix("$ "))
    assert command[command.index("--max-num-seqs") + 1] == "48", command
