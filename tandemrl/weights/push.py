"""Pushing the trainer's weights to the inference servers: by disk or by bucketed broadcast.

Written once for every backend: a training engine only exports (``save`` in HF format,
``hf_param_specs`` and ``iter_hf_params``). Trainer rank 0 talks to the servers through a
``WeightReceiver`` and, for collective updates, hosts the weight-update group
(``tandemrl.weights.group``: its TCP store and port) until ``close``; the buckets go out in
``tandemrl.weights.wire``'s format, or as ``tandemrl.weights.delta`` changes.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tandemrl.api.engine import TrainBackend
from tandemrl.api.inference import ParamSpec, WeightUpdateMeta, serves_adapter
from tandemrl.api.types import SaveLoadMeta
from tandemrl.utils import stats_tracker
from tandemrl.weights import delta
from tandemrl.weights.group import destroy_group, host_group
from tandemrl.weights.wire import bucket_layout, bucket_nbytes, pack_bucket, split_buckets, to_dtype

logger = logging.getLogger(__name__)

# Broadcasts queued at once: the next bucket is packed (and encoded) while the previous one is on the wire.
MAX_IN_FLIGHT = 4
LEAVE_TIMEOUT_S = 60.0  # how long a failed update waits for the servers to leave the weight group


class WeightReceiver(Protocol):
    """The server-side weight calls of an inference client (``RemoteInferenceClient`` implements them)."""

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def adapter_rank_limit(self) -> int: ...

    def update_adapter_from_disk(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def leave_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs: list[list[ParamSpec]]) -> Any:
        """Start the servers' receive of every bucket (one request per server where the backend allows)."""
        ...


def bucket_plan(specs: list[ParamSpec], bucket_size_mb: int, dtype: str | None = None) -> list[list[ParamSpec]]:
    """The broadcast buckets of ``specs`` (in order; a decoder layer never splits), floats sent as ``dtype``."""
    fake = ((s.name, torch.empty(s.shape, dtype=_send_dtype(to_dtype(s.dtype), dtype), device="meta")) for s in specs)
    return [
        [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b]
        for b in split_buckets(fake, bucket_size_mb << 20)
    ]


def _send_dtype(exported: torch.dtype, dtype: str | None) -> torch.dtype:
    return to_dtype(dtype) if dtype is not None and exported.is_floating_point else exported


@dataclasses.dataclass
class SyncStats:
    """One push as rank 0 saw it; recorded as ``weight_sync/*`` scalars of the default stats tracker."""

    bytes: int = 0  # sent over the wire (collective: payloads and headers) or written (disk: safetensors)
    full_bytes: int = 0  # what sending every tensor whole moves (a LoRA adapter update: the adapter's)
    adapter: bool = False  # a LoRA adapter was sent, not the (merged) model
    seconds: float = 0.0
    changed: int = 0  # delta updates: elements whose bits changed since the last update
    elements: int = 0  # ... out of this many compared

    def record(self) -> None:
        values = {"bytes": self.bytes, "full_bytes": self.full_bytes, "seconds": self.seconds}
        values["gb_per_s"] = self.full_bytes / max(self.seconds, 1e-9) / 1e9
        if self.elements:
            values["changed_fraction"] = self.changed / self.elements
        stats_tracker.scalar(**{f"weight_sync/{k}": v for k, v in values.items()})


class _DeltaState:
    """The flat buckets rank 0 sent last in delta mode; the servers hold the same copy."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.plan: list[list[ParamSpec]] | None = None
        self.tag: str | None = None
        self.since_anchor = 0

    def anchor_due(self, plan: list[list[ParamSpec]], anchor_every: int) -> bool:
        return self.tag is None or plan != self.plan or self.since_anchor + 1 >= anchor_every

    def commit(self, plan: list[list[ParamSpec]], tag: str, anchor: bool) -> None:
        self.plan, self.tag = plan, tag
        self.since_anchor = 0 if anchor else self.since_anchor + 1


def wants_adapter(rank: int, serve: str, device_type: str) -> bool:
    """Whether a LoRA engine's disk push should try to send its adapter alone (``lora.serve``; a CPU engine means
    CPU servers, so ``auto`` pushes merged weights there)."""
    return rank > 0 and serves_adapter(serve, on_gpu=device_type != "cpu")


def adapter_fits(rank: int, serve: str, limit: int) -> bool:
    """True to send the adapter to servers that load adapters up to rank ``limit`` (0: none); one-line errors."""
    if 0 < limit < rank:
        raise ValueError(
            f"lora.rank={rank} exceeds the inference servers' max LoRA rank {limit} "
            f"(vLLM: start them with --max-lora-rank >= {rank})"
        )
    if limit == 0 and serve == "adapter":
        raise ValueError(
            "lora.serve=adapter, but the inference servers load no adapters at run time "
            "(vLLM: --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); set lora.serve=auto or merged"
        )
    return limit > 0


class WeightPusher:
    """Sends one engine's weights to the servers behind one client; collective over all trainer ranks."""

    def __init__(self, engine: TrainBackend, client: WeightReceiver) -> None:
        self.engine = engine
        self.client = client
        self._group: Any = None
        self._delta = _DeltaState()
        self._pack_buffers: list[torch.Tensor] = []  # rank 0's host buffers, one per bucket (_pack_buffer)
        self._send_adapter: bool | None = None  # decided at the first disk push (docs/lora.md)
        self.last_stats: SyncStats | None = None  # rank 0's figures of the last push

    def push(self, meta: WeightUpdateMeta) -> None:
        """Install the engine's current weights on every server, labelled ``meta.version``."""
        stats, start = SyncStats(), time.perf_counter()
        if meta.type == "disk":
            self._push_disk(meta, stats)
        elif meta.type == "collective":
            self._push_collective(meta, stats)
        else:
            raise ValueError(f"WeightUpdateMeta.type: unknown type '{meta.type}' (disk or collective)")
        if self._is_sender():
            stats.seconds = time.perf_counter() - start
            stats.record()
            self.last_stats = stats
        dist.barrier()

    @staticmethod
    def _is_sender() -> bool:
        return dist.get_rank() == 0

    def _push_disk(self, meta: WeightUpdateMeta, stats: SyncStats) -> None:
        """The model as HF safetensors, or only its LoRA adapter (PEFT) when the servers load adapters."""
        assert meta.path is not None
        stats.adapter = self._adapter_updates()
        self.engine.save(SaveLoadMeta(path=meta.path, weight_format="peft" if stats.adapter else "hf"))
        if self._is_sender():
            files = glob.glob(os.path.join(meta.path, "*.safetensors"))
            stats.bytes = stats.full_bytes = sum(os.path.getsize(f) for f in files)
            load = self.client.update_adapter_from_disk if stats.adapter else self.client.update_weights_from_disk
            load(meta).result()

    def _adapter_updates(self) -> bool:
        """Collective, once: send the adapter alone, or the merged weights (``lora.serve``, docs/lora.md).

        Rank 0 asks the servers whether they load adapters and tells the other ranks, which must
        save in the same format; every rank computes ``wants_adapter`` from the same config and device.
        """
        if self._send_adapter is None:
            rank, serve = self.engine.lora_rank, self.engine.lora_serve
            wanted = wants_adapter(rank, serve, self.engine.device.type)
            decision = torch.zeros((), dtype=torch.int64, device=self.engine.device)
            if wanted and self._is_sender():
                decision.fill_(int(adapter_fits(rank, serve, self.client.adapter_rank_limit())))
            if wanted:
                dist.broadcast(decision, 0)
            self._send_adapter = bool(decision)
        return self._send_adapter

    def _push_collective(self, meta: WeightUpdateMeta, stats: SyncStats) -> None:
        """Plan the buckets, start the servers' receive of the WHOLE plan, then broadcast bucket by bucket.

        The servers learn every bucket's specs up front (vLLM: in one RPC per server) and
        receive the broadcasts in plan order inside that call, so the trainer streams the
        buckets without a round trip between them. In delta mode rank 0 keeps the buckets it
        sent; any failure drops them, so the next update is a full anchor.
        """
        plan = bucket_plan(self.engine.hf_param_specs(), meta.bucket_size_mb, meta.dtype)
        sender = self._is_sender()
        deltas = meta.delta != "none"
        anchor = deltas and self._delta.anchor_due(plan, meta.anchor_every)
        if deltas and sender:
            meta = dataclasses.replace(meta, delta_tag=uuid.uuid4().hex, delta_base=None if anchor else self._delta.tag)
            if anchor:
                self._delta.sent = []  # freed before the new copy is built
        stream = None
        try:
            if sender:  # the group in no local: a failed update's traceback holds this frame, not its port
                stream = _Broadcasts(
                    self, self._host_group(meta), self.client.update_weights_from_distributed(meta, plan), meta
                )
            params = self.engine.iter_hf_params()
            send_dtype = to_dtype(meta.dtype) if meta.dtype is not None else None
            reuse = not deltas and self._comm_device(meta).type == "cpu"  # delta mode keeps what it sent
            for b, bucket in enumerate(plan):
                tensors = [next(params) for _ in bucket]
                if stream is None:
                    continue
                out = self._pack_buffer(b, bucket_nbytes(bucket)) if reuse else None
                flat, sent = pack_bucket(tensors, dtype=send_dtype, out=out)
                if sent != bucket:  # the servers unpack by the plan: a mismatch would load garbage
                    got = next(f"{a} != {b}" for a, b in zip(sent, bucket, strict=True) if a != b)
                    raise RuntimeError(f"push_weights: iter_hf_params disagrees with hf_param_specs: {got}")
                flat = flat.to(self._comm_device(meta))
                stats.full_bytes += flat.numel()
                if deltas:
                    self._send_delta(b, bucket, flat, delta.KINDS[meta.delta], stream, stats)
                else:
                    stream.send(flat)
                    stats.bytes += flat.numel()
            if stream is not None:
                stream.finish()
        except BaseException:
            self._delta.reset()
            self._pack_buffers = []  # an abandoned broadcast may still read them
            raise
        if deltas and sender:
            assert meta.delta_tag is not None
            self._delta.commit(plan, meta.delta_tag, anchor)

    def _pack_buffer(self, b: int, size: int) -> torch.Tensor:
        """Bucket ``b``'s host buffer, kept from the last update when its size matches.

        A fresh buffer of a few hundred MB costs more to fault in than to fill (on a 2-core host
        0.10-0.18 s against 0.02 s for 394 MB), so collective updates over host memory reuse them:
        rank 0 holds one update's bytes between pushes. A bucket is rewritten only in the next
        push, after ``_Broadcasts.finish`` saw every broadcast of this one complete.
        """
        bufs = self._pack_buffers
        if b < len(bufs) and bufs[b].numel() == size:
            return bufs[b]
        del bufs[b:]
        bufs.append(torch.empty(size, dtype=torch.uint8))
        return bufs[b]

    def _send_delta(
        self, b: int, specs: list[ParamSpec], flat: torch.Tensor, kind: int, stream: _Broadcasts, stats: SyncStats
    ) -> None:
        """Header and payload of bucket ``b``: its change against the last-sent copy, or whole if smaller."""
        payload, used = flat, delta.FULL
        if b < len(self._delta.sent):
            base = self._delta.sent[b]
            sizes = [(o, n, to_dtype(s.dtype).itemsize) for s, (o, n) in zip(specs, bucket_layout(specs), strict=True)]
            stats.changed += delta.changed_elements(flat, base, sizes)
            stats.elements += sum(n // size for _, n, size in sizes)
            encoded = delta.encode(kind, flat, base)
            if encoded.numel() < flat.numel():
                payload, used = encoded, kind
            self._delta.sent[b] = flat
        else:
            self._delta.sent.append(flat)
        head = delta.header(used, payload.numel(), delta.checksum(flat), flat.device)
        stream.send(head)
        stream.send(payload)
        stats.bytes += head.numel() * head.element_size() + payload.numel()

    def _host_group(self, meta: WeightUpdateMeta) -> Any:
        """The weight-update group, built on first use: the servers are asked to join while rank 0 hosts it."""
        if self._group is None:
            joined = self.client.init_weights_update_group(meta)
            self._group = host_group(meta.group_addr, meta.group_port, meta.world_size, meta.comm_backend)
            joined.result()
        return self._group

    def _comm_device(self, meta: WeightUpdateMeta) -> torch.device:
        return self.engine.device if meta.comm_backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Close the weight-update group (rank 0 frees its store and port); the next push opens a new one."""
        group, self._group = self._group, None
        destroy_group(group)
        self._pack_buffers = []
        self._delta.reset()  # the servers' copies belong to that group's updates


class _Broadcasts:
    """Rank 0's broadcasts of one update, up to ``MAX_IN_FLIGHT`` queued; fails at once if the servers gave up.

    A server that rejects a weight (vLLM: a name its model lacks) still takes the rest of
    the update's broadcasts before its receive request fails, so ``finish`` reports it right
    after the last bucket. A request that fails before receiving everything (the server died
    or refused the call; a bad delta base; or a per-bucket backend that stops sending
    requests) never joins the next broadcast: waiting on it would block until the group's timeout.
    """

    def __init__(self, pusher: WeightPusher, group: Any, servers: Future[None], meta: WeightUpdateMeta) -> None:
        self.pusher, self.group, self.servers, self.meta = pusher, group, servers, meta
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()

    def send(self, t: torch.Tensor) -> None:
        self.pending.append((self.group.broadcast(t, 0), t))  # t stays alive until sent
        while len(self.pending) > MAX_IN_FLIGHT:
            self._wait(self.pending.popleft()[0])

    def finish(self) -> None:
        while self.pending:
            self._wait(self.pending.popleft()[0])
        self.servers.result()

    def _wait(self, work: Any) -> None:
        while not work.is_completed():
            failed = self.servers.exception() if self.servers.done() else None
            if failed is not None:
                # The error (kept by the servers' future) will hold this frame: not the work, which
                # holds the group and so rank 0's store and port.
                del work
                self._abandon_group()
                raise failed
            time.sleep(0.002)
        work.wait()

    def _abandon_group(self) -> None:
        """Drop the group after a failed update; the next update builds a new one.

        A gloo group whose broadcast no peer will join cannot be destroyed (dropped, shut down
        or aborted) until its timeout or until the peers' side is gone, so the servers leave it
        first; a server that cannot be asked is dead, and its side went with it.
        """
        try:
            self.pusher.client.leave_weights_update_group(self.meta).result(LEAVE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the update's own error is the one to report
            logger.warning("weight update failed; asking the servers to leave the weight group also failed: %s", e)
        self.group = None  # the error holds this object (see _wait), so not the group
        self.pending.clear()
        self.pusher.close()  # frees rank 0's store and port for the next group
