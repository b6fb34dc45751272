"""Client of a fleet of remote inference servers: generation, pause/resume, versions.

``RemoteInferenceClient`` runs on every trainer process. It finds the servers (explicit list,
``InferenceClientConfig.server_addrs`` or the launcher's ``TANDEMRL_LLM_SERVER_ADDRS``),
routes each generation call to one of them, and survives the two things that interrupt
a generation: a weight update and a server dying (the partial output is resubmitted to
another server). At a weight update ``InferenceClientConfig.pause_mode`` decides: "abort"
(the server returns in-flight requests' partial output and the client resubmits prompt +
partial output once generation resumes) or "keep" (the server holds them and continues them
on the new weights; the client's call simply lasts longer). Requests are built and parsed by an
``InferenceBackend`` and sent by the shared client in ``tandemrl.inference.http``.

Its weight-update calls are ``WeightCalls`` (``tandemrl.inference.weight_calls``); the server list
(``ServerPool``, ``parse_server_addrs``, ``ServerUnavailableError``) is ``tandemrl.inference.server_pool``,
re-exported here.

The client owns no rollout machinery: ``tandemrl.rollout`` (the executor and the
``RolloutController``) drives it through ``agenerate``, the pause/resume calls and the
weight-update calls.

Servers: sticky per ``ModelRequest.rid`` (samples and turns of one prompt reuse one
server's KV cache), otherwise round-robin. A server whose request still fails after
``request_retries`` retries is marked dead for the engine's lifetime (after the next
weight update its weights would be stale anyway) and its requests fail over; when no
server is left, calls raise ``ServerUnavailableError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from tandemrl.api.backend import InferenceBackend
from tandemrl.api.inference import (
    PAUSE_MODES,
    HttpRequest,
    ModelRequest,
    ModelResponse,
    StopReason,
)
from tandemrl.api.renamed import retired_names
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.busy import BusyClock
from tandemrl.inference.http import HttpClient, InferenceServerError, shared_client
from tandemrl.inference.registry import backend_class
from tandemrl.inference.server_pool import SERVER_ADDRS_ENV, ServerPool, ServerUnavailableError, parse_server_addrs
from tandemrl.inference.weight_calls import WeightCalls

logger = logging.getLogger(__name__)


class RemoteInferenceClient(WeightCalls):
    """Generation client of remote inference servers; see the module docstring. Its weight-update calls
    are ``WeightCalls`` (``tandemrl.inference.weight_calls``)."""

    # After an "abort" (a pause for a weight update), wait this long before resubmitting.
    abort_retry_delay = 0.1
    # How often a generation waiting for the servers to resume re-checks.
    pause_poll_interval = 0.05

    @classmethod
    def for_backend(
        cls, name: str, config: InferenceClientConfig, http_client: HttpClient | None = None
    ) -> RemoteInferenceClient:
        """The client of allocation_mode's inference backend ``name``, its row in ``inference.registry``."""
        return cls(config, backend_class(name).from_config(config), http_client)

    def __init__(
        self, config: InferenceClientConfig, backend: InferenceBackend, http_client: HttpClient | None = None
    ) -> None:
        if config.request_retries < 0:
            raise ValueError(f"InferenceClientConfig.request_retries must be >= 0, got {config.request_retries}")
        if config.request_backoff < 0:
            raise ValueError(f"InferenceClientConfig.request_backoff must be >= 0, got {config.request_backoff}")
        if config.setup_timeout <= 0:
            raise ValueError(f"InferenceClientConfig.setup_timeout must be positive, got {config.setup_timeout}")
        if config.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"InferenceClientConfig.pause_mode must be one of {PAUSE_MODES}, got {config.pause_mode!r}"
            )
        self.config = config
        self.backend = backend
        # The pause a weight update sends (built now: a backend that cannot keep requests says so here).
        self._update_pause = backend.build_pause(config.pause_mode)
        self._http_client = http_client
        self._pool: ServerPool | None = None
        self._version = 0
        self._state_lock = threading.Lock()
        self._user_paused = False  # pause_generation() without continue_generation()
        self._updates_running = 0  # weight updates holding the servers paused
        self.held_calls = 0  # generate calls (or resubmissions) that found generation paused and waited
        self._sleep_level: int | None = None  # set between sleep() and wake_up()
        self._busy = BusyClock()  # time with a generate request of this client in flight
        self._resubmit_lock = threading.Lock()
        self._resubmitted_tokens = 0  # prompt + partial output tokens sent again after an "abort"

    # ------------------------------------------------------------------ lifecycle
    @property
    def http(self) -> HttpClient:
        return self._http_client if self._http_client is not None else shared_client()

    @property
    def pool(self) -> ServerPool:
        if self._pool is None:
            raise RuntimeError(f"{type(self).__name__}: call initialize() first")
        return self._pool

    @property
    def addresses(self) -> list[str]:
        return list(self.pool.addrs)

    def initialize(self, addrs: list[str] | None = None) -> None:
        """Find the servers and wait until all are healthy."""
        if self._pool is not None:
            raise RuntimeError(f"{type(self).__name__} is already initialized")
        found = self._discover(addrs)
        self.http.run_sync(self._wait_healthy(found))
        self._pool = ServerPool(found)
        logger.info("%s: %d %s server(s): %s", type(self).__name__, len(found), self.backend.name, ", ".join(found))

    def destroy(self) -> None:
        """Forget the servers (the shared HTTP client stays up)."""
        self._pool = None

    def _discover(self, addrs: list[str] | None) -> list[str]:
        if addrs:
            return parse_server_addrs(list(addrs), "initialize(addrs=...)")
        if self.config.server_addrs:
            return parse_server_addrs(list(self.config.server_addrs), "InferenceClientConfig.server_addrs")
        env = os.environ.get(SERVER_ADDRS_ENV, "")
        found = [a for a in env.split(",") if a.strip()]
        if not found:
            raise ValueError(
                "no inference servers: pass initialize(addrs=[...]), set InferenceClientConfig.server_addrs, "
                f"or export {SERVER_ADDRS_ENV}=host:port[,host:port...]"
            )
        return parse_server_addrs(found, f"${SERVER_ADDRS_ENV}")

    async def _wait_healthy(self, addrs: list[str]) -> None:
        timeout = self.config.setup_timeout
        deadline = time.monotonic() + timeout
        health = self.backend.build_health()
        pending = list(addrs)
        last: dict[str, str] = {}

        async def probe(addr: str) -> bool:
            left = max(0.1, min(5.0, deadline - time.monotonic()))
            try:
                await self.http.send(addr, dataclasses.replace(health, timeout=left))
                return True
            except InferenceServerError as e:
                last[addr] = e.detail
                return False

        while True:
            ok = await asyncio.gather(*(probe(a) for a in pending))
            pending = [a for a, good in zip(pending, ok, strict=True) if not good]
            if not pending:
                return
            if time.monotonic() >= deadline:
                why = "; ".join(f"{a} ({health.method} {health.path}: {last.get(a, 'no reply')})" for a in pending)
                raise ServerUnavailableError(
                    f"{len(pending)} of {len(addrs)} {self.backend.name} servers not healthy within "
                    f"InferenceClientConfig.setup_timeout={timeout:g}s: {why}"
                )
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ versions
    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int, sync_servers: bool = False) -> None:
        """Set the weight version stamped on tokens the servers leave unlabelled.

        ``sync_servers`` also relabels the servers' current weights (a weight update whose
        ``meta.version`` is set does that itself).
        """
        self._version = int(version)
        if sync_servers:
            self.http.run_sync(self._broadcast(self.backend.build_set_version(self._version)))

    # ------------------------------------------------------------------ generation
    def generation_paused(self) -> bool:
        """True while the servers are (being) paused by this engine."""
        with self._state_lock:
            return self._user_paused or self._updates_running > 0

    def take_busy_seconds(self) -> float:
        """Seconds with at least one of this client's generate requests in flight since the last call."""
        return self._busy.take()

    def take_resubmitted_tokens(self) -> int:
        """Tokens (prompt + partial output) resubmitted after an "abort" since the last call: what the
        servers prefilled again because a pause returned the requests (never in ``pause_mode`` "keep"
        unless something else aborted them)."""
        with self._resubmit_lock:
            n, self._resubmitted_tokens = self._resubmitted_tokens, 0
        return n

    async def _wait_until_generating(self) -> None:
        if not self.generation_paused():
            return
        with self._state_lock:
            self.held_calls += 1
        while self.generation_paused():
            await asyncio.sleep(self.pause_poll_interval)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Continue ``req.input_ids`` by up to ``gconfig.max_new_tokens`` tokens (one sample).

        Interrupted calls ("abort") are resubmitted with the output so far and the budget
        left once this client lifts its pause, which it does just before it sends the servers
        their resume (a paused vLLM server holds a request until then); a dead server's partial
        state goes to another one.
        A request kept over a weight update (``pause_mode`` "keep") is one call whose tokens
        the server labels with the version of the weights that produced each of them.
        Tokens a server leaves unlabelled get the engine version at the time of the call.
        """
        max_new = req.gconfig.max_new_tokens
        if max_new < 1:
            raise ValueError(f"ModelRequest {req.rid}: gconfig.max_new_tokens must be >= 1, got {max_new}")
        pool = self.pool
        start = time.perf_counter()
        ttft = math.inf
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop: StopReason = "abort"
        interrupted = False
        addr = pool.choose(req.rid)
        while True:
            remaining = max_new - len(tokens)
            if remaining <= 0:
                stop = "length"
                break
            if interrupted:  # let the weight update that aborted us get going first
                await asyncio.sleep(self.abort_retry_delay)
                with self._resubmit_lock:
                    self._resubmitted_tokens += len(req.input_ids) + len(tokens)
            await self._wait_until_generating()
            version = self.get_version()
            call = self.backend.build_generate(req, tokens, remaining, version)
            with self._busy.running():
                sent, payload = await self._send_or_mark_dead(addr, call)
            if not sent:
                addr = pool.choose(req.rid)
                logger.warning("request %s: failing over to %s with %d tokens so far", req.rid, addr, len(tokens))
                interrupted = False
                continue
            chunk = self.backend.parse_generate(payload)
            if chunk.output_tokens and ttft == math.inf:
                ttft = time.perf_counter() - start
            tokens += chunk.output_tokens
            logprobs += chunk.output_logprobs
            versions += chunk.token_versions(fallback=version)
            stop = chunk.stop_reason
            if stop != "abort":
                break
            interrupted = True
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop,
            latency=time.perf_counter() - start,
            ttft=ttft,
        )

    async def aprompt_logprobs(self, token_ids: list[int], rid: str | None = None) -> list[float]:
        """The servers' logprob of each of ``token_ids[1:]`` given its prefix (temperature 1), nothing sampled.

        What a teacher model's server gives on-policy distillation
        (``tandemrl.workflows.distill``). Sticky per ``rid`` like generation; a server that still
        fails after ``request_retries`` is marked dead and the call goes to another one.
        """
        call = self.backend.build_prompt_logprobs(list(token_ids), rid or uuid.uuid4().hex)
        while True:
            sent, payload = await self._send_or_mark_dead(self.pool.choose(rid), call)
            if sent:
                return self.backend.parse_prompt_logprobs(payload, list(token_ids))

    async def _send_or_mark_dead(self, addr: str, call: HttpRequest) -> tuple[bool, Any]:
        """``(True, reply)``; or ``(False, None)`` once ``addr`` failed transiently past its retries and
        was marked dead (the caller fails over). Other failures raise."""
        try:
            return True, await self.http.send(
                addr, call, retries=self.config.request_retries, backoff=self.config.request_backoff
            )
        except InferenceServerError as e:
            if not e.retryable:
                raise
            self.pool.mark_dead(addr, f"{call.method} {call.path}: {e.detail}")
            return False, None

    # ------------------------------------------------------------------ control
    async def _broadcast(self, req: HttpRequest) -> None:
        """Send a control request to every live server; unreachable ones are marked dead."""
        pool = self.pool
        live = pool.live()
        results = await asyncio.gather(
            *(
                self.http.send(a, req, retries=self.config.request_retries, backoff=self.config.request_backoff)
                for a in live
            ),
            return_exceptions=True,
        )
        for addr, result in zip(live, results, strict=True):
            if isinstance(result, InferenceServerError) and result.retryable:
                pool.mark_dead(addr, f"{req.method} {req.path}: {result.detail}")
            elif isinstance(result, BaseException):
                raise result
        if not pool.live():
            raise ServerUnavailableError(pool.all_dead_message())

    def pause_generation(self) -> None:
        """Pause every server: in-flight requests return partial output (always "abort": ``pause_mode`` is
        for weight updates), new ones wait."""
        with self._state_lock:
            self._user_paused = True
        self.http.run_sync(self._broadcast(self.backend.build_pause()))

    def continue_generation(self) -> None:
        """Undo ``pause_generation`` (servers stay paused while a weight update runs)."""
        with self._state_lock:
            self._user_paused = False
            resume = self._updates_running == 0
        if resume:
            self.http.run_sync(self._broadcast(self.backend.build_resume()))

    def sleep(self, level: int) -> None:
        """Colocated placement: pause every server, then (``level`` >= 1) free its device memory.

        Level 0 only stops generation: what a CPU server needs to leave the cores to the trainer.
        Weight updates work while asleep at level 0; at level 1 call ``wake_up`` first.
        """
        if level < 0:
            raise ValueError(f"sleep: level must be >= 0, got {level}")
        self.pause_generation()
        if level >= 1:
            self.http.run_sync(self._broadcast(self.backend.build_sleep(level)))
        self._sleep_level = level

    def wake_up(self) -> None:
        """Undo ``sleep``: memory back on every server, then generation resumes."""
        if self._sleep_level is None:
            raise RuntimeError("wake_up: the servers were not put to sleep by this client")
        if self._sleep_level >= 1:
            self.http.run_sync(self._broadcast(self.backend.build_wake_up()))
        self._sleep_level = None
        self.continue_generation()


__all__ = [
    "SERVER_ADDRS_ENV",
    "RemoteInferenceClient",
    "ServerPool",
    "ServerUnavailableError",
    "parse_server_addrs",
]

if not TYPE_CHECKING:  # old names fail with the line naming the new one (tandemrl.api.renamed)
    __getattr__ = retired_names(__name__)
