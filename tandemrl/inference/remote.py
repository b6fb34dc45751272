"""Client of a fleet of remote inference servers: generation, pause/resume, weight updates.

``RemoteInfEngine`` runs on every trainer process. It finds the servers (explicit list,
``InferenceEngineConfig.server_addrs`` or the launcher's ``TANDEMRL_LLM_SERVER_ADDRS``),
routes each generation call to one of them, and survives the two things that interrupt
a generation: a weight update and a server dying (the partial output is resubmitted to
another server). At a weight update ``InferenceEngineConfig.pause_mode`` decides: "abort"
(the server returns in-flight requests' partial output and the client resubmits prompt +
partial output once generation resumes) or "keep" (the server holds them and continues them
on the new weights; the client's call simply lasts longer). Requests are built and parsed by an
``InferenceBackend`` and sent by the shared client in ``tandemrl.inference.http``.

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
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tandemrl.api.backend import InferenceBackend
from tandemrl.api.inference import (
    PAUSE_MODES,
    HttpRequest,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    StopReason,
    WeightUpdateMeta,
)
from tandemrl.configs.rollout import InferenceEngineConfig
from tandemrl.inference.busy import BusyClock
from tandemrl.inference.http import HttpClient, InferenceServerError, shared_client

logger = logging.getLogger(__name__)

SERVER_ADDRS_ENV = "TANDEMRL_LLM_SERVER_ADDRS"  # comma-separated host:port list the launcher exports


class ServerUnavailableError(RuntimeError):
    """No inference server can take the call (none healthy at setup, or all marked dead)."""


# ----------------------------------------------------------------------------- servers


def parse_server_addrs(addrs: list[str], source: str) -> list[str]:
    """``addrs`` after checking each is ``host:port``; the one-line error names ``source``."""
    out: list[str] = []
    for raw in addrs:
        addr = str(raw).strip()
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{source}: bad inference server address {raw!r} (expected host:port)")
        if addr in out:
            raise ValueError(f"{source}: inference server {addr!r} is listed twice")
        out.append(addr)
    return out


class ServerPool:
    """Which server a request goes to, and which servers are dead (thread-safe)."""

    def __init__(self, addrs: list[str], max_sticky: int = 100_000) -> None:
        if not addrs:
            raise ValueError("ServerPool needs at least one server address")
        self.addrs = list(addrs)
        self._dead: dict[str, str] = {}  # addr -> why
        self._sticky: OrderedDict[str, str] = OrderedDict()  # rid -> addr, oldest first
        self._max_sticky = max_sticky
        self._next = 0
        self._lock = threading.Lock()

    def live(self) -> list[str]:
        with self._lock:
            return [a for a in self.addrs if a not in self._dead]

    def dead(self) -> dict[str, str]:
        with self._lock:
            return dict(self._dead)

    def is_dead(self, addr: str) -> bool:
        with self._lock:
            return addr in self._dead

    def mark_dead(self, addr: str, why: str) -> None:
        with self._lock:
            if addr not in self._dead:
                self._dead[addr] = why
                logger.warning("inference server %s marked dead: %s", addr, why)

    def choose(self, rid: str | None) -> str:
        """The live server ``rid`` used last, else the next live one round-robin."""
        with self._lock:
            if rid is not None:
                addr = self._sticky.get(rid)
                if addr is not None and addr not in self._dead:
                    self._sticky.move_to_end(rid)
                    return addr
            n = len(self.addrs)
            for i in range(n):
                addr = self.addrs[(self._next + i) % n]
                if addr not in self._dead:
                    self._next = (self._next + i + 1) % n
                    break
            else:
                raise ServerUnavailableError(self.all_dead_message())
            if rid is not None:
                self._sticky[rid] = addr
                self._sticky.move_to_end(rid)
                while len(self._sticky) > self._max_sticky:
                    self._sticky.popitem(last=False)
            return addr

    def all_dead_message(self) -> str:
        why = "; ".join(f"{a} ({self._dead[a]})" for a in self.addrs)
        return f"all {len(self.addrs)} inference servers are marked dead: {why}"


# ------------------------------------------------------------------------------ engine


class RemoteInfEngine:
    """Generation client of remote inference servers; see the module docstring."""

    # After an "abort" (a pause for a weight update), wait this long before resubmitting.
    abort_retry_delay = 0.1
    # How often a generation waiting for the servers to resume re-checks.
    pause_poll_interval = 0.05

    def __init__(
        self, config: InferenceEngineConfig, backend: InferenceBackend, http_client: HttpClient | None = None
    ) -> None:
        if config.request_retries < 0:
            raise ValueError(f"InferenceEngineConfig.request_retries must be >= 0, got {config.request_retries}")
        if config.request_backoff < 0:
            raise ValueError(f"InferenceEngineConfig.request_backoff must be >= 0, got {config.request_backoff}")
        if config.setup_timeout <= 0:
            raise ValueError(f"InferenceEngineConfig.setup_timeout must be positive, got {config.setup_timeout}")
        if config.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"InferenceEngineConfig.pause_mode must be one of {PAUSE_MODES}, got {config.pause_mode!r}"
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
            return parse_server_addrs(list(self.config.server_addrs), "InferenceEngineConfig.server_addrs")
        env = os.environ.get(SERVER_ADDRS_ENV, "")
        found = [a for a in env.split(",") if a.strip()]
        if not found:
            raise ValueError(
                "no inference servers: pass initialize(addrs=[...]), set InferenceEngineConfig.server_addrs, "
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
                    f"InferenceEngineConfig.setup_timeout={timeout:g}s: {why}"
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
        while self.generation_paused():
            await asyncio.sleep(self.pause_poll_interval)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Continue ``req.input_ids`` by up to ``gconfig.max_new_tokens`` tokens (one sample).

        Interrupted calls ("abort") are resubmitted with the output so far and the budget
        left, after the servers resume; a dead server's partial state goes to another one.
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

    # ------------------------------------------------------------------ weight updates
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """Load the HF checkpoint at ``meta.path`` into every live server, in the background.

        Call it once the trainer has finished writing ``meta.path``. The servers are paused
        for the update and resumed afterwards; with ``meta.version`` set, the servers'
        weights are relabelled and the engine's version becomes ``meta.version`` before
        they resume. A dead server is skipped (it never comes back).
        """
        if meta.type != "disk":
            raise ValueError(f"update_weights_from_disk needs a 'disk' WeightUpdateMeta, got type {meta.type!r}")
        steps = self.backend.build_update_from_disk(meta)
        plan = {addr: list(steps) for addr in self.pool.live()}
        return self._start_update(plan, meta.version, pause=True, skip_dead=True)

    def adapter_rank_limit(self) -> int:
        """The largest LoRA rank every live server loads at run time; 0 if one of them loads none."""
        probe = self.backend.build_lora_probe()

        async def ask() -> list[int]:
            replies = await asyncio.gather(*(self.http.send(a, probe) for a in self.pool.live()))
            return [self.backend.parse_lora_probe(r) for r in replies]

        limits = self.http.run_sync(ask())
        if not limits:
            raise ServerUnavailableError(self.pool.all_dead_message())
        return min(limits)

    def update_adapter_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """Load the PEFT adapter directory at ``meta.path`` into every live server, in the background.

        As ``update_weights_from_disk`` (paused, relabelled with ``meta.version``, dead servers
        skipped); once loaded, every later generation uses the adapter.
        """
        if meta.type != "disk":
            raise ValueError(f"update_adapter_from_disk needs a 'disk' WeightUpdateMeta, got type {meta.type!r}")
        steps = self.backend.build_load_adapter(meta)
        plan = {addr: list(steps) for addr in self.pool.live()}
        return self._start_update(plan, meta.version, pause=True, skip_dead=True, after=self.backend.adapter_loaded)

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """Ask every server to join the trainer's weight-update group, in the background.

        The servers' ranks are ``1..meta.world_size-1``, split evenly in server order; the
        calls block until the trainer (rank 0) joins too, so create rank 0 after this.
        """
        addrs = self._all_servers_for_collective("init_weights_update_group", meta)
        per_server = (meta.world_size - 1) // len(addrs)
        plan = {a: [self.backend.build_init_weight_group(meta, 1 + i * per_server)] for i, a in enumerate(addrs)}
        return self._start_update(plan, None, pause=False)

    def leave_weights_update_group(self, meta: WeightUpdateMeta) -> concurrent.futures.Future[None]:
        """Ask every live server to leave the weight-update group, in the background (see
        ``InferenceBackend.build_leave_weight_group``); a dead one has left already."""
        plan = {a: [self.backend.build_leave_weight_group(meta)] for a in self.pool.live()}
        return self._start_update(plan, None, pause=False, skip_dead=True)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs_per_bucket: list[list[ParamSpec]]
    ) -> concurrent.futures.Future[None]:
        """Receive the trainer's broadcast buckets on every server, in the background.

        The trainer broadcasts the buckets in this order while the future runs. A backend
        with ``multi_bucket_collective`` gets ONE request per server listing every bucket;
        otherwise one request per bucket, sent in order. The servers are paused, receive,
        drop stale KV cache, get relabelled (``meta.version``) and are resumed, as in
        ``update_weights_from_disk``.
        """
        addrs = self._all_servers_for_collective("update_weights_from_distributed", meta)
        buckets = list(param_specs_per_bucket)
        if not buckets or not all(buckets):
            raise ValueError("update_weights_from_distributed: param_specs_per_bucket must hold non-empty buckets")
        per_request = [buckets] if self.backend.multi_bucket_collective else [[b] for b in buckets]
        steps = [self.backend.build_update_from_collective(meta, group) for group in per_request]
        steps.append(self.backend.build_flush_cache())
        if meta.version is not None:
            steps.append(self.backend.build_set_version(meta.version))
        return self._start_update({a: list(steps) for a in addrs}, meta.version, pause=True)

    def _all_servers_for_collective(self, what: str, meta: WeightUpdateMeta) -> list[str]:
        """Every server (the group's size counts all of them), after checking none is dead."""
        if meta.type != "collective":
            raise ValueError(f"{what} needs a 'collective' WeightUpdateMeta, got type {meta.type!r}")
        pool = self.pool
        dead = pool.dead()
        if dead:
            raise ServerUnavailableError(
                f"{what}: the weight-update group needs all {len(pool.addrs)} servers, but "
                + "; ".join(f"{a} is dead ({why})" for a, why in dead.items())
            )
        n = len(pool.addrs)
        if (meta.world_size - 1) % n:
            raise ValueError(
                f"{what}: WeightUpdateMeta.world_size - 1 = {meta.world_size - 1} inference ranks do not split "
                f"evenly over {n} servers"
            )
        return list(pool.addrs)

    def _start_update(
        self,
        plan: dict[str, list[HttpRequest]],
        version: int | None,
        pause: bool,
        skip_dead: bool = False,
        after: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future[None]:
        """``after`` runs once the plan succeeded, before the servers resume."""
        if not plan:
            raise ServerUnavailableError(self.pool.all_dead_message())
        if pause and version is None and self.config.pause_mode == "keep":
            raise ValueError(
                "InferenceEngineConfig.pause_mode='keep' needs WeightUpdateMeta.version: the prefix cache of "
                "requests sent after the update is keyed by it (a kept request's old-weight KV cannot be flushed)"
            )
        if pause:
            with self._state_lock:
                self._updates_running += 1  # generations wait from now on
        try:
            return self.http.submit(self._update(plan, version, pause, skip_dead, after))
        except BaseException:
            if pause:
                with self._state_lock:
                    self._updates_running -= 1
            raise

    async def _update(
        self,
        plan: dict[str, list[HttpRequest]],
        version: int | None,
        pause: bool,
        skip_dead: bool,
        after: Callable[[], None] | None = None,
    ) -> None:
        """``skip_dead``: a server found dead (at the pause or during its steps) is left out
        (disk loads); otherwise the update fails with one line naming it (a collective group
        needs every member)."""
        failed: BaseException | None = None
        try:
            if pause:
                await self._broadcast(self._update_pause)
            dead = {a: why for a, why in self.pool.dead().items() if a in plan}
            if dead and not skip_dead:
                raise ServerUnavailableError(
                    "weight update: " + "; ".join(f"inference server {a} is dead ({why})" for a, why in dead.items())
                )
            await self._run_plan({a: s for a, s in plan.items() if a not in dead}, skip_dead)
            if after is not None:
                after()
            if version is not None:
                self.set_version(version)
        except BaseException as e:
            failed = e
            raise
        finally:
            if pause:
                try:
                    await self._end_update()
                except Exception as e:
                    if failed is None:
                        raise
                    logger.error("resuming servers after a failed weight update also failed: %s", e)

    async def _end_update(self) -> None:
        with self._state_lock:
            self._updates_running -= 1
            resume = self._updates_running == 0 and not self._user_paused
        if resume:
            await self._broadcast(self.backend.build_resume())

    async def _run_plan(self, plan: dict[str, list[HttpRequest]], skip_dead: bool = False) -> None:
        """Each server's steps in order, servers concurrently; no retries (a receive is not repeatable).

        ``skip_dead``: a server that cannot be reached is marked dead and left out, as long as one is left.
        """

        async def run(addr: str, steps: list[HttpRequest]) -> None:
            for step in steps:
                try:
                    await self.http.send(addr, step, retries=0)
                except InferenceServerError as e:
                    if not (skip_dead and e.retryable and e.status is None):
                        raise
                    self.pool.mark_dead(addr, f"{step.method} {step.path}: {e.detail}")
                    return

        if not plan:
            raise ServerUnavailableError(self.pool.all_dead_message())
        results = await asyncio.gather(*(run(a, s) for a, s in plan.items()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) > 1:
                logger.error("weight update failed on %d of %d servers", len(errors), len(plan))
            raise errors[0]
        if not self.pool.live():
            raise ServerUnavailableError(self.pool.all_dead_message())


class RemoteVLLMEngine(RemoteInfEngine):
    """``RemoteInfEngine`` talking to vLLM servers."""

    def __init__(self, config: InferenceEngineConfig, http_client: HttpClient | None = None) -> None:
        from tandemrl.inference.vllm import VLLMBackend

        super().__init__(config, VLLMBackend.from_config(config), http_client)


class RemoteSGLangEngine(RemoteInfEngine):
    """``RemoteInfEngine`` talking to SGLang servers."""

    def __init__(self, config: InferenceEngineConfig, http_client: HttpClient | None = None) -> None:
        from tandemrl.inference.sglang import SGLangBackend

        super().__init__(config, SGLangBackend.from_config(config), http_client)


__all__ = [
    "SERVER_ADDRS_ENV",
    "RemoteInfEngine",
    "RemoteSGLangEngine",
    "RemoteVLLMEngine",
    "ServerPool",
    "ServerUnavailableError",
    "parse_server_addrs",
]


def remote_engine_for(backend: str, config: InferenceEngineConfig) -> RemoteInfEngine:
    """The client for allocation_mode's inference backend ("vllm" or "sglang")."""
    classes: dict[str, Callable[[InferenceEngineConfig], RemoteInfEngine]] = {
        "vllm": RemoteVLLMEngine,
        "sglang": RemoteSGLangEngine,
    }
    if backend not in classes:
        raise ValueError(f"allocation_mode: inference backend '{backend}' has no client (vllm or sglang)")
    return classes[backend](config)
