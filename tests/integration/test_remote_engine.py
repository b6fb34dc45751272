"""RemoteInferenceClient and the shared HTTP client against real HTTP servers on loopback.

``FakeVLLM`` is an in-process aiohttp server speaking the shapes of vLLM's
``/inference/v1/generate``, ``/pause``, ``/resume``, ``/health`` and weight routes: a
protocol peer that lets the client's retry, failover and resubmission logic be driven
deterministically. The next token is a pure function of the sequence so far (its
position and first token), so a stitched output equals the uninterrupted one exactly
when no token was lost or duplicated. The real vLLM server is exercised by the one
``slow`` test at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any

import pytest
import torch
from aiohttp import web
from test_executor import wait_until
from utils import free_port

from tandemrl.api.inference import HttpRequest, ModelRequest, ModelResponse, ParamSpec, WeightUpdateMeta
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference import http as http_module
from tandemrl.inference.http import MAX_BACKOFF, HttpClient, InferenceServerError, retry_delay, send, send_sync
from tandemrl.inference.remote import (
    SERVER_ADDRS_ENV,
    RemoteInferenceClient,
    ServerUnavailableError,
)
from tandemrl.rollout.executor import WorkflowExecutor

PROMPT = [11, 5, 8]


def next_token(seq: list[int]) -> int:
    return (len(seq) * 7 + seq[0]) % 997


def next_logprob(seq: list[int]) -> float:
    return -(len(seq) % 50) / 100.0


def expected(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The output an uninterrupted FakeVLLM generation of ``n`` tokens gives."""
    seq, lps = list(prompt), []
    for _ in range(n):
        lps.append(next_logprob(seq))
        seq.append(next_token(seq))
    return seq[len(prompt) :], lps


class FakeVLLM:
    """A loopback HTTP server with vLLM's request/reply shapes; see the module docstring.

    Knobs: ``fail_next`` (answer that many generate calls with HTTP 500), ``abort_after``
    (each generate call stops with "abort" after that many tokens, as when paused),
    ``hold_at`` (a call that reaches output position ``hold_at`` of a ``PROMPT`` request,
    having produced a token itself, waits there until the server is paused or stopped: it
    cannot finish first, on any machine; ``wait_held(n)`` waits for n such calls),
    ``health_status`` (of every ``/health``, after the first ``health_fail_next`` ones, which get 503).
    """

    def __init__(self, abort_after: int | None = None, hold_at: int | None = None) -> None:
        self.abort_after = abort_after
        self.hold_at = hold_at
        self._held = 0
        self._held_cond = threading.Condition()
        self.fail_next = 0
        self.health_status = 200
        self.health_fail_next = 0
        self.version_label = "default"
        self.generate_bodies: list[dict[str, Any]] = []
        self.rpc_bodies: list[dict[str, Any]] = []
        self.log: list[str] = []  # "METHOD path?query" of every request, in arrival order
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._handlers: dict[int, tuple[asyncio.Task[Any] | None, web.Request]] = {}  # in-flight generates
        self._running = asyncio.Event()  # set = not paused
        self._pause_epoch = 0
        self._paused_signal: asyncio.Event | None = None  # set (and replaced) by every pause

    def wait_held(self, n: int, timeout: float = 60.0) -> None:
        """Block the test thread until ``n`` calls are held at ``hold_at``."""
        with self._held_cond:
            if not self._held_cond.wait_for(lambda: self._held >= n, timeout):
                raise TimeoutError(f"{self._held} of {n} generate calls held after {timeout}s")

    # ---- lifecycle (called from the test thread)
    def start(self) -> FakeVLLM:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._running.set()
        self._paused_signal = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/update_weight_version", self._set_version)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/reset_prefix_cache", self._ok)
        # SGLang's weight-update routes (for the shared client's per-bucket path), recorded like RPCs.
        for path in ("/init_weights_update_group", "/update_weights_from_distributed"):
            app.router.add_post(path, self._rpc)
        for path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            app.router.add_post(path, self._ok)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await self._site.start()

    def stop(self) -> None:
        """Die abruptly: refuse new connections and drop in-flight ones without replying."""
        if self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        assert self._site is not None and self._runner is not None
        await self._site.stop()
        for task, request in list(self._handlers.values()):
            if request.transport is not None:
                request.transport.abort()
            if task is not None:
                task.cancel()
        await self._runner.cleanup()
        self._runner = None

    # ---- routes

    async def _health(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        if self.health_fail_next > 0:
            self.health_fail_next -= 1
            return web.Response(status=503)
        return web.Response(status=self.health_status)

    async def _ok(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        return web.json_response({"success": True})

    async def _rpc(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        self.rpc_bodies.append(await request.json())
        return web.json_response({"results": [None]})

    async def _set_version(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        self.version_label = (await request.json())["new_version"]
        return web.json_response({"status": "ok"})

    async def _pause(self, request: web.Request) -> web.Response:
        """ "abort": in-flight calls return "abort"; "keep": they wait, then go on after ``/resume``."""
        self.log.append(f"{request.method} {request.path_qs}")
        mode = request.query.get("mode")
        assert mode in ("abort", "keep")
        if mode == "abort":
            self._pause_epoch += 1
        self._running.clear()
        assert self._paused_signal is not None
        self._paused_signal.set()
        self._paused_signal = asyncio.Event()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        self._running.set()
        return web.json_response({"status": "resumed"})

    async def _generate(self, request: web.Request) -> web.Response:
        self.log.append(f"{request.method} {request.path_qs}")
        self._handlers[id(request)] = (asyncio.current_task(), request)
        try:
            body = await request.json()
            self.generate_bodies.append(body)
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.json_response({"error": {"message": "engine core died\ntraceback..."}}, status=500)
            await self._running.wait()  # like vLLM: requests arriving while paused are held
            epoch = self._pause_epoch
            seq = list(body["token_ids"])
            params = body["sampling_params"]
            out: list[int] = []
            content: list[dict[str, Any]] = []
            labels: list[str] = []
            finish = "length"
            for _ in range(params["max_tokens"]):
                if out and self.hold_at is not None and len(seq) - len(PROMPT) == self.hold_at:
                    await self._hold(epoch)
                if self._pause_epoch != epoch or (self.abort_after is not None and len(out) >= self.abort_after):
                    finish = "abort"
                    break
                await self._running.wait()  # kept by a pause in mode "keep"
                tok, lp = next_token(seq), next_logprob(seq)
                seq.append(tok)
                out.append(tok)
                content.append({"token_id": tok, "logprob": lp, "rank": 1, "top_logprobs": []})
                labels.append(self.version_label)
                if tok in params["stop_token_ids"]:
                    finish = "stop"
                    break
            choice = {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": out,
                "logprobs": {"content": content},
                "weight_versions": _spans(labels),
            }
            return web.json_response({"request_id": f"generate-tokens-{body['request_id']}", "choices": [choice]})
        finally:
            self._handlers.pop(id(request), None)

    async def _hold(self, epoch: int) -> None:
        """Wait (no timer) until a pause after ``epoch``; a stop cancels the wait."""
        assert self._paused_signal is not None
        signal = self._paused_signal
        with self._held_cond:
            self._held += 1
            self._held_cond.notify_all()
        if self._pause_epoch == epoch:
            await signal.wait()


def _spans(labels: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


@pytest.fixture
def servers():
    started: list[FakeVLLM] = []

    def make(n: int = 1, **kwargs: Any) -> list[FakeVLLM]:
        new = [FakeVLLM(**kwargs).start() for _ in range(n)]
        started.extend(new)
        return new

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def engines():
    made: list[RemoteInferenceClient] = []

    def make(addrs: list[str] | None, **cfg: Any) -> RemoteInferenceClient:
        defaults: dict[str, Any] = {"request_retries": 2, "request_backoff": 0.02, "setup_timeout": 5.0}
        engine = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(**{**defaults, **cfg}))
        made.append(engine)
        engine.initialize(addrs)
        return engine

    yield make
    for e in made:
        e.destroy()


def make_req(max_new_tokens: int, rid: str | None = None, prompt: list[int] = PROMPT) -> ModelRequest:
    req = ModelRequest(input_ids=list(prompt))
    if rid is not None:
        req.rid = rid
    req.gconfig.max_new_tokens = max_new_tokens
    return req


def generate_all(engine: RemoteInferenceClient, reqs: list[ModelRequest]) -> list[ModelResponse]:
    async def run() -> list[ModelResponse]:
        return list(await asyncio.gather(*(engine.agenerate(r) for r in reqs)))

    return asyncio.run(run())


def assert_exact(resp: ModelResponse, prompt: list[int], n: int) -> None:
    toks, lps = expected(prompt, n)
    assert resp.output_tokens == toks
    assert resp.output_logprobs == pytest.approx(lps)
    assert len(resp.output_versions) == n


def prefixes_sent(server: FakeVLLM) -> list[int]:
    """Partial-output lengths each generate call to ``server`` carried."""
    return [len(b["token_ids"]) - len(PROMPT) for b in server.generate_bodies]


# ------------------------------------------------------------------------------ http client


def test_send_retries_5xx_then_succeeds_and_4xx_fails_at_once(servers) -> None:
    (srv,) = servers(1)
    body = {"request_id": "x", "token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "stop_token_ids": []}}
    req = HttpRequest("POST", "/inference/v1/generate", body, timeout=5.0)
    srv.fail_next = 2
    payload = asyncio.run(send(srv.addr, req, retries=2, backoff=0.01))
    assert payload["choices"][0]["token_ids"] == expected(PROMPT, 3)[0]
    assert len(srv.generate_bodies) == 3  # 2 x HTTP 500, then the good one

    srv.fail_next = 5
    with pytest.raises(InferenceServerError) as exc:
        send_sync(srv.addr, req, retries=1, backoff=0.01)  # from a plain thread: no event loop here
    msg = str(exc.value)
    assert "\n" not in msg and srv.addr in msg and "/inference/v1/generate" in msg, msg
    assert "HTTP 500" in msg and "engine core died" in msg and "2 attempts" in msg, msg
    assert exc.value.retryable and exc.value.status == 500

    with pytest.raises(InferenceServerError) as exc:
        send_sync(srv.addr, HttpRequest("GET", "/no_such_route"), retries=3, backoff=0.01)
    assert exc.value.status == 404 and not exc.value.retryable and exc.value.attempts == 1  # 4xx: no retry
    assert "/no_such_route" in str(exc.value) and "\n" not in str(exc.value)


def test_retry_delay_doubles_up_to_the_cap() -> None:
    assert [retry_delay(0.05, a) for a in (1, 2, 3)] == pytest.approx([0.05, 0.1, 0.2])
    assert retry_delay(0.5, 5) == 8.0 and retry_delay(0.5, 6) == MAX_BACKOFF == 10.0
    assert retry_delay(0.0, 3) == 0.0


def test_send_connection_refused_is_retryable_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = f"127.0.0.1:{free_port()}"
    client = HttpClient("test-client")
    waits: list[float] = []

    def recorded_delay(backoff: float, attempt: int) -> float:  # the real delay, noted
        waits.append(retry_delay(backoff, attempt))
        return waits[-1]

    monkeypatch.setattr(http_module, "retry_delay", recorded_delay)
    try:
        with pytest.raises(InferenceServerError) as exc:
            client.send_sync(addr, HttpRequest("GET", "/health", timeout=2.0), retries=2, backoff=0.05)
        assert waits == pytest.approx([0.05, 0.1])  # a backoff before each of the two retries, none after the last
        assert exc.value.retryable and exc.value.status is None and exc.value.attempts == 3
        assert f"GET http://{addr}/health failed after 3 attempts" in str(exc.value)
        assert "\n" not in str(exc.value)
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.send_sync(addr, HttpRequest("GET", "/health"))


# ------------------------------------------------------------------------ discovery, health


def test_discovery_from_env_var(servers, engines, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = servers(2)
    monkeypatch.setenv(SERVER_ADDRS_ENV, f"{a.addr}, {b.addr}")
    engine = engines(None)
    assert engine.addresses == [a.addr, b.addr]
    assert a.log == ["GET /health"] and b.log == ["GET /health"]

    monkeypatch.setenv(SERVER_ADDRS_ENV, f"{a.addr},localhost")
    with pytest.raises(ValueError) as exc:
        RemoteInferenceClient.for_backend("vllm", InferenceClientConfig()).initialize()
    assert f"${SERVER_ADDRS_ENV}" in str(exc.value) and "'localhost'" in str(exc.value)

    monkeypatch.delenv(SERVER_ADDRS_ENV)
    with pytest.raises(ValueError, match=SERVER_ADDRS_ENV):
        RemoteInferenceClient.for_backend("vllm", InferenceClientConfig()).initialize()


def test_health_check_failure_names_unreachable_servers(servers) -> None:
    good, sick = servers(2)
    sick.health_status = 503
    missing = f"127.0.0.1:{free_port()}"
    engine = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(setup_timeout=1.0))
    with pytest.raises(ServerUnavailableError) as exc:
        engine.initialize([good.addr, sick.addr, missing])
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert "2 of 3 vllm servers not healthy" in msg and "setup_timeout=1s" in msg, msg
    assert f"{sick.addr} (GET /health: HTTP 503" in msg and f"{missing} (GET /health: " in msg, msg
    assert good.addr not in msg and good.log == ["GET /health"]  # a healthy server is not probed again
    with pytest.raises(RuntimeError, match="initialize"):
        asyncio.run(engine.agenerate(make_req(2)))


def test_initialize_probes_a_starting_server_until_it_is_healthy(servers, engines) -> None:
    """Within setup_timeout, a server that answers 503 at first is probed again until it is healthy."""
    (late,) = servers(1)
    late.health_fail_next = 2
    engines([late.addr], setup_timeout=600.0)
    assert late.log == ["GET /health"] * 3 and late.health_fail_next == 0


# ------------------------------------------------------------------------------ routing


def test_round_robin_and_sticky_rid(servers, engines) -> None:
    a, b = servers(2)
    engine = engines([a.addr, b.addr])
    generate_all(engine, [make_req(2, rid=f"r{i}") for i in range(6)])
    # The server is chosen in submission order; the calls then race, so arrival order is free.
    assert sorted(bd["request_id"] for bd in a.generate_bodies) == ["r0", "r2", "r4"]
    assert sorted(bd["request_id"] for bd in b.generate_bodies) == ["r1", "r3", "r5"]

    # Group samples and later turns of one rid stay on its server (KV reuse).
    for _ in range(2):
        generate_all(engine, [make_req(2, rid="group-1") for _ in range(4)])
    on_a = [bd["request_id"] for bd in a.generate_bodies].count("group-1")
    on_b = [bd["request_id"] for bd in b.generate_bodies].count("group-1")
    assert sorted([on_a, on_b]) == [0, 8]


# ------------------------------------------------------------------------ interruptions


def test_abort_resubmits_with_remaining_budget(servers, engines) -> None:
    (srv,) = servers(1, abort_after=4)  # every call is cut after 4 tokens, as by a pause
    engine = engines([srv.addr])
    before = time.perf_counter()
    (resp,) = generate_all(engine, [make_req(10, rid="long")])
    after = time.perf_counter()
    assert_exact(resp, PROMPT, 10)
    assert resp.stop_reason == "length" and resp.output_versions == [0] * 10
    budgets = [bd["sampling_params"]["max_tokens"] for bd in srv.generate_bodies]
    assert budgets == [10, 6, 2]
    assert prefixes_sent(srv) == [0, 4, 8]
    assert engine.take_resubmitted_tokens() == (3 + 4) + (3 + 8) and engine.take_resubmitted_tokens() == 0
    toks = expected(PROMPT, 10)[0]
    assert srv.generate_bodies[2]["token_ids"] == PROMPT + toks[:8]
    # Seconds from the call's start to its reply: within the span of the call, on any machine.
    assert 0 < resp.ttft <= resp.latency and before + resp.latency <= after


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_weight_update_mid_generation_versions_and_tokens(servers, engines, mode: str) -> None:
    """ "abort": each request is resubmitted once with its 5 tokens; "keep": each stays one call."""
    a, b = servers(2, hold_at=5)  # each request is mid-generation (5 tokens out) when the update comes
    engine = engines([a.addr, b.addr], pause_mode=mode)
    reqs = [make_req(40, rid=f"u{i}") for i in range(4)]

    async def run() -> list[ModelResponse]:
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        for srv in (a, b):
            await asyncio.to_thread(srv.wait_held, 2)
        fut = engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path="/ckpt/step1", version=1))
        assert engine.generation_paused()  # set before the call returns
        await asyncio.wrap_future(fut)
        return list(await asyncio.gather(*tasks))

    resps = asyncio.run(run())
    assert engine.get_version() == 1 and not engine.generation_paused()
    for srv in (a, b):
        control = [e for e in srv.log if "generate" not in e and "health" not in e]
        assert control == [
            "POST /pause?mode=abort" if mode == "abort" else "POST /pause?mode=keep&clear_cache=false",
            "POST /collective_rpc",
            "POST /reset_prefix_cache",
            "POST /update_weight_version",
            "POST /resume",
        ]
        assert sorted(prefixes_sent(srv)) == ([0, 0, 5, 5] if mode == "abort" else [0, 0])
    assert engine.take_resubmitted_tokens() == (4 * (len(PROMPT) + 5) if mode == "abort" else 0)
    for resp in resps:
        assert_exact(resp, PROMPT, 40)
        assert resp.output_versions == [0] * 5 + [1] * 35  # old weights, then new, never mixed back
        assert resp.stop_reason == "length"


def test_server_dies_mid_run_requests_finish_on_the_other(servers, engines) -> None:
    a, b = servers(2, abort_after=3)
    a.hold_at = 4  # a's requests are in flight (second call, 1 token into it) when it dies
    engine = engines([a.addr, b.addr], request_retries=1)
    reqs = [make_req(30, rid=f"d{i}") for i in range(6)]

    async def run() -> list[ModelResponse]:
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        await asyncio.to_thread(a.wait_held, 3)
        await asyncio.to_thread(a.stop)
        return list(await asyncio.gather(*tasks))

    resps = asyncio.run(run())
    for resp in resps:
        assert_exact(resp, PROMPT, 30)  # nothing lost, nothing duplicated
    assert engine.pool.is_dead(a.addr) and not engine.pool.is_dead(b.addr)
    moved = {bd["request_id"] for bd in b.generate_bodies} & {bd["request_id"] for bd in a.generate_bodies}
    assert moved, "no request failed over from the dead server"
    # A failed-over request continued from its partial output, not from scratch.
    first_on_b = {}
    for bd in b.generate_bodies:
        first_on_b.setdefault(bd["request_id"], len(bd["token_ids"]) - len(PROMPT))
    assert all(first_on_b[rid] == 3 for rid in moved), first_on_b

    # New requests keep flowing to the live server only.
    n_a = len(a.generate_bodies)
    generate_all(engine, [make_req(5, rid=f"late{i}") for i in range(3)])
    assert len(a.generate_bodies) == n_a


def test_disk_update_skips_a_server_that_died_unnoticed(servers, engines) -> None:
    """A server dead since the last call (nothing marked it yet): the disk update loads on the
    survivor, marks the dead one, and relabels; a collective update then refuses in one line."""
    a, b = servers(2)
    engine = engines([a.addr, b.addr], request_retries=0)
    a.stop()
    engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path="/ckpt/step1", version=1)).result(30)
    assert engine.pool.live() == [b.addr] and engine.get_version() == 1
    assert [body["kwargs"]["path"] for body in b.rpc_bodies] == ["/ckpt/step1"] and b.version_label == "1"
    assert b.log[-1] == "POST /resume"  # the survivor was resumed
    meta = WeightUpdateMeta(type="collective", group_port=free_port(), world_size=3, version=2)
    with pytest.raises(ServerUnavailableError) as e:
        engine.update_weights_from_distributed(meta, [[ParamSpec("w", (2,), "float32")]])
    assert "\n" not in str(e.value) and f"{a.addr} is dead" in str(e.value)
    b.stop()
    with pytest.raises(ServerUnavailableError, match="all 2 inference servers are marked dead"):
        engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path="/ckpt/step2", version=2)).result(30)


def test_retry_then_failover_after_5xx(servers, engines) -> None:
    a, b = servers(2)
    engine = engines([a.addr, b.addr], request_retries=2)
    a.fail_next = 2  # two 500s, then OK: retried on the same server
    (resp,) = generate_all(engine, [make_req(5, rid="r0")])
    assert_exact(resp, PROMPT, 5)
    assert len(a.generate_bodies) == 3 and b.generate_bodies == []
    assert not engine.pool.is_dead(a.addr)

    b.fail_next = 10  # keeps failing: marked dead after 1 + 2 attempts, request goes to a
    (resp,) = generate_all(engine, [make_req(5, rid="r1")])
    assert_exact(resp, PROMPT, 5)
    assert len(b.generate_bodies) == 3 and engine.pool.is_dead(b.addr)


def test_only_server_dies_clear_error_within_timeout(servers, engines) -> None:
    (srv,) = servers(1, hold_at=5)
    engine = engines([srv.addr], request_retries=2, request_backoff=0.05, request_timeout=600.0)

    async def run() -> None:
        task = asyncio.ensure_future(engine.agenerate(make_req(200, rid="only")))
        await asyncio.to_thread(srv.wait_held, 1)
        await asyncio.to_thread(srv.stop)
        await task

    with pytest.raises(ServerUnavailableError) as exc:
        asyncio.run(run())
    msg = str(exc.value)
    # refused connections ended it, not the 600 s request timeout ("no reply within 600s")
    assert "Cannot connect to host" in msg and "no reply within" not in msg, msg
    assert "\n" not in msg and "all 1 inference servers are marked dead" in msg and srv.addr in msg, msg
    assert "/inference/v1/generate" in msg, msg
    with pytest.raises(ServerUnavailableError):
        engine.pause_generation()


def test_pause_generation_holds_requests_until_continue(servers, engines) -> None:
    (srv,) = servers(1, hold_at=7)
    engine = engines([srv.addr])

    async def run() -> ModelResponse:
        task = asyncio.ensure_future(engine.agenerate(make_req(30, rid="p")))
        await asyncio.to_thread(srv.wait_held, 1)
        await asyncio.to_thread(engine.pause_generation)
        # The aborted call reaches its resubmission and waits there (a call that ignored the pause never would).
        await asyncio.to_thread(wait_until, lambda: engine.held_calls == 1, "the aborted call to wait on the pause")
        assert not task.done() and len(srv.generate_bodies) == 1  # aborted, waiting to resubmit
        await asyncio.to_thread(engine.continue_generation)
        return await task

    resp = asyncio.run(run())
    assert_exact(resp, PROMPT, 30)
    assert prefixes_sent(srv) == [0, 7]
    assert srv.generate_bodies[1]["sampling_params"]["max_tokens"] == 30 - 7
    log = [e for e in srv.log if "health" not in e]
    assert log[:2] == ["POST /inference/v1/generate", "POST /pause?mode=abort"]
    # The resubmission is sent once continue_generation lifts the pause, which it does before sending
    # /resume: the two race to the server (which holds a generate until /resume), so either comes first.
    assert sorted(log[2:]) == ["POST /inference/v1/generate", "POST /resume"]


def test_pause_mode_bad_values_are_one_line_errors_naming_the_field(servers, engines) -> None:
    with pytest.raises(ValueError, match="InferenceClientConfig.pause_mode") as exc:
        RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(pause_mode="hold"))
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="InferenceClientConfig.pause_mode='keep' is not supported") as exc:
        RemoteInferenceClient.for_backend(
            "sglang", InferenceClientConfig(pause_mode="keep")
        )  # refused before any server is asked
    assert "\n" not in str(exc.value)
    (srv,) = servers(1)
    engine = engines([srv.addr], pause_mode="keep")
    with pytest.raises(ValueError, match="WeightUpdateMeta.version") as exc:
        engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path="/ckpt/unlabelled"))
    assert "\n" not in str(exc.value) and not engine.generation_paused()
    engine.pause_generation()  # a pause of the user's own still returns in-flight requests ("abort")
    engine.continue_generation()
    assert [e for e in srv.log if "health" not in e] == ["POST /pause?mode=abort", "POST /resume"]


def test_collective_update_rank_offsets_and_bucket_sequence(servers, engines) -> None:
    a, b = servers(2)
    engine = engines([a.addr, b.addr])
    meta = WeightUpdateMeta(type="collective", group_port=29999, world_size=5, comm_backend="gloo", version=4)
    engine.init_weights_update_group(meta).result(10)
    assert [r["kwargs"]["rank"] for r in a.rpc_bodies + b.rpc_bodies] == ["1", "3"]  # 2 ranks per server
    assert all(r["method"] == "tandemrl_init_weight_group" for r in a.rpc_bodies + b.rpc_bodies)
    assert a.log[-1] == "POST /collective_rpc"  # joining the group does not pause generation

    buckets = [
        [ParamSpec("w1", (2, 3), "bfloat16")],
        [ParamSpec("w2", (4,), "float32"), ParamSpec("w3", (1,), "int64")],
    ]
    engine.update_weights_from_distributed(meta, buckets).result(10)
    assert engine.get_version() == 4
    for srv in (a, b):
        # vLLM: ONE receive RPC per server per update, listing every bucket in broadcast order.
        assert len(srv.rpc_bodies) == 2 and srv.rpc_bodies[1]["method"] == "tandemrl_recv_weights"
        assert json.loads(srv.rpc_bodies[1]["kwargs"]["meta_json"]) == [
            [["w1", "bfloat16", [2, 3]]],
            [["w2", "float32", [4]], ["w3", "int64", [1]]],
        ]
        assert srv.log[-5:] == [
            "POST /pause?mode=abort",
            "POST /collective_rpc",
            "POST /reset_prefix_cache",
            "POST /update_weight_version",
            "POST /resume",
        ]
        assert srv.version_label == "4"

    with pytest.raises(ValueError, match="do not split evenly over 2 servers"):
        engine.init_weights_update_group(dataclasses.replace(meta, world_size=4))
    engine.pool.mark_dead(b.addr, "test")
    with pytest.raises(ServerUnavailableError, match="needs all 2 servers"):
        engine.update_weights_from_distributed(meta, buckets)


def test_collective_update_one_request_per_bucket_for_sglang(servers) -> None:
    """A backend without multi-bucket receive (SGLang) gets one request per bucket, in broadcast order."""
    (srv,) = servers(1)
    config = InferenceClientConfig(request_retries=0, setup_timeout=5.0)
    engine = RemoteInferenceClient.for_backend("sglang", config)
    engine.initialize([srv.addr])
    try:
        assert engine.backend.multi_bucket_collective is False
        meta = WeightUpdateMeta(type="collective", group_port=29998, world_size=2, comm_backend="gloo", version=2)
        buckets = [
            [ParamSpec("w1", (2, 3), "bfloat16")],
            [ParamSpec("w2", (4,), "float32"), ParamSpec("w3", (1,), "int64")],
            [ParamSpec("w4", (5,), "float32")],
        ]
        engine.update_weights_from_distributed(meta, buckets).result(10)
        assert [r["names"] for r in srv.rpc_bodies] == [["w1"], ["w2", "w3"], ["w4"]]
        assert srv.log[-7:] == [
            "POST /pause_generation",
            "POST /update_weights_from_distributed",
            "POST /update_weights_from_distributed",
            "POST /update_weights_from_distributed",
            "POST /flush_cache",
            "POST /update_weight_version",
            "POST /continue_generation",
        ]
        assert engine.get_version() == 2 and srv.version_label == "2"
    finally:
        engine.destroy()


# ------------------------------------------------------------------- executor over the client


class EchoWorkflow(RolloutWorkflow):
    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        resp = await engine.agenerate(make_req(4, prompt=[int(data["id"]) + 1, 2, 3]))
        ids = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
        }


def test_executor_drives_the_client(servers, engines) -> None:
    """The client owns no executor; a WorkflowExecutor over it rolls out, pauses and follows its version."""
    (srv,) = servers(1)
    engine = engines([srv.addr])
    assert not hasattr(engine, "executor") and not hasattr(RemoteInferenceClient, "rollout_batch")
    executor = WorkflowExecutor(engine.config, engine, consumer_batch_size=3)
    executor.initialize()
    try:
        batch = executor.rollout_batch([{"id": i} for i in range(3)], workflow=EchoWorkflow(), timeout=30)
        for row, i in zip(batch["input_ids"].tolist(), range(3), strict=True):
            prompt = [i + 1, 2, 3]
            assert row == prompt + expected(prompt, 4)[0]
        executor.pause()
        assert executor.is_paused()
        executor.resume()
        engine.set_version(3)
        assert executor.get_version() == 3
    finally:
        executor.destroy()


# ------------------------------------------------------------------------------ real vLLM


class CountingClient(HttpClient):
    """The real client, recording the path and body of every request it sends."""

    def __init__(self) -> None:
        super().__init__("counting-client")
        self.paths: list[str] = []
        self.generate_bodies: list[dict[str, Any]] = []

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        self.paths.append(req.path)
        if req.path == "/inference/v1/generate":
            self.generate_bodies.append(req.json)
        return await super().send(addr, req, *args, **kwargs)


@pytest.mark.slow
def test_agenerate_against_real_vllm(vllm_server) -> None:
    """Greedy decoding on the real server, interrupted by a pause, still gives the full output.

    The server's test hook (tests/vllm_gate.py) holds the request between tokens until the test
    grants one, so the pause always interrupts it mid-decode, on any machine and any load.
    """
    client = CountingClient()
    config = InferenceClientConfig(request_retries=1, request_backoff=0.1, setup_timeout=60)
    engine = RemoteInferenceClient.for_backend("vllm", config, http_client=client)
    engine.initialize([vllm_server.proc.address])
    try:
        n = 64
        prompt = [5, 17, 42, 99, 100, 7, 301, 12]
        req = make_req(n, rid="real-1", prompt=prompt)
        req.gconfig.greedy = True
        req.metadata["ignore_eos"] = True
        engine.set_version(7)  # the server labels tokens "default": they get the engine's version

        async def run() -> ModelResponse:
            with vllm_server.gate(prompt) as gate:
                task = asyncio.ensure_future(engine.agenerate(req))
                held = await asyncio.to_thread(gate.wait_held)
                await asyncio.to_thread(gate.release_until, engine.pause_generation, held, n - 1)
                cut = gate.last_held + 1  # tokens out when the pause aborted it
            await asyncio.to_thread(engine.continue_generation)
            resp = await task
            # Interrupted once and resubmitted once, with the partial output and the remaining budget.
            # The resubmission is sent once continue_generation lifts the pause, which it does before
            # sending /resume: the two race (vLLM holds a generate until /resume), so either comes first.
            generate = "/inference/v1/generate"
            assert client.paths[:3] == ["/health", generate, "/pause?mode=abort"], client.paths
            assert sorted(client.paths[3:]) == sorted([generate, "/resume"]), client.paths
            second = client.generate_bodies[1]
            assert second["token_ids"] == prompt + resp.output_tokens[:cut]
            assert second["sampling_params"]["max_tokens"] == n - cut
            return resp

        resp = asyncio.run(run())
        assert resp.output_len == n and resp.stop_reason == "length"
        assert len(resp.output_logprobs) == n and all(lp <= 0.0 for lp in resp.output_logprobs)
        assert resp.output_versions == [7] * n
        assert 0 < resp.ttft <= resp.latency

        # An uninterrupted greedy run starts identically (after the resubmission point, bf16
        # prefill-vs-decode numerics may flip near-ties, so only the head is compared).
        plain = asyncio.run(engine.agenerate(req))
        assert plain.output_len == n and client.paths.count("/inference/v1/generate") == 3
        assert resp.output_tokens[:16] == plain.output_tokens[:16]
        assert resp.output_logprobs[:16] == pytest.approx(plain.output_logprobs[:16], abs=1e-3)
    finally:
        engine.destroy()
        client.close()
