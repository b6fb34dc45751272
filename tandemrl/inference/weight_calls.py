"""The inference client's weight-update calls: what a weight push asks of every server.

``WeightCalls`` is composed into ``RemoteInferenceClient`` (``tandemrl.inference.remote``), which keeps
generation, pause/resume and versions. Its calls load a checkpoint or a LoRA adapter from disk, or
join, receive through and leave the trainer's weight-update group (``tandemrl.weights``); each runs
in the background on the shared HTTP client, pausing the servers for the update (``pause_mode``) and
relabelling them with ``WeightUpdateMeta.version`` before they resume. Generations wait while an
update holds the servers (``_updates_running``, shared with the client's own pause).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandemrl.api.backend import InferenceBackend
from tandemrl.api.inference import HttpRequest, ParamSpec, WeightUpdateMeta
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.http import HttpClient, InferenceServerError
from tandemrl.inference.server_pool import ServerPool, ServerUnavailableError

logger = logging.getLogger(__name__)


class WeightCalls:
    """The weight-update half of the inference client (see the module docstring)."""

    config: InferenceClientConfig
    backend: InferenceBackend
    _state_lock: threading.Lock
    _updates_running: int  # weight updates holding the servers paused
    _user_paused: bool
    _update_pause: HttpRequest  # the pause a weight update sends (built by the client from pause_mode)

    if TYPE_CHECKING:  # provided by the client

        @property
        def http(self) -> HttpClient: ...

        @property
        def pool(self) -> ServerPool: ...

        def set_version(self, version: int, sync_servers: bool = False) -> None: ...

        async def _broadcast(self, req: HttpRequest) -> None: ...

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
                "InferenceClientConfig.pause_mode='keep' needs WeightUpdateMeta.version: the prefix cache of "
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


__all__ = ["WeightCalls"]
