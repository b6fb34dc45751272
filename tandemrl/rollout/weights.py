"""Pushing the trainer's weights to the inference servers: by disk or by bucketed broadcast.

Written once for every backend: a training engine only exports (``save`` in HF format,
``hf_param_specs`` and ``iter_hf_params``). Trainer rank 0 talks to the servers and, for
collective updates, hosts the weight-update group (its TCP store and port) until ``close``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tandemrl.api.engine import TrainEngine
from tandemrl.api.inference import ParamSpec, WeightUpdateMeta
from tandemrl.api.types import SaveLoadMeta
from tandemrl.inference.weight_group import (
    create_trainer_weight_group,
    destroy_weight_group,
    pack_bucket,
    split_buckets,
)


class WeightReceiver(Protocol):
    """The server-side weight calls of an inference client (``RemoteInfEngine`` implements them)."""

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]: ...

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs: list[list[ParamSpec]]) -> Any:
        """Start the servers' receive of every bucket (one request per server where the backend allows)."""
        ...


def bucket_plan(specs: list[ParamSpec], bucket_size_mb: int) -> list[list[ParamSpec]]:
    """The broadcast buckets of ``specs`` (in order; a decoder layer never splits)."""
    fake = ((s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta")) for s in specs)
    return [
        [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b]
        for b in split_buckets(fake, bucket_size_mb << 20)
    ]


class WeightPusher:
    """Sends one engine's weights to the servers behind one client; collective over all trainer ranks."""

    def __init__(self, engine: TrainEngine, client: WeightReceiver) -> None:
        self.engine = engine
        self.client = client
        self._weight_group: Any = None

    def push(self, meta: WeightUpdateMeta) -> None:
        """Install the engine's current weights on every server, labelled ``meta.version``."""
        if meta.type == "disk":
            self._push_disk(meta)
        elif meta.type == "collective":
            self._push_collective(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type: unknown type '{meta.type}' (disk or collective)")
        dist.barrier()

    @staticmethod
    def _is_sender() -> bool:
        return dist.get_rank() == 0

    def _push_disk(self, meta: WeightUpdateMeta) -> None:
        assert meta.path is not None
        self.engine.save(SaveLoadMeta(path=meta.path, weight_format="hf"))
        if self._is_sender():
            self.client.update_weights_from_disk(meta).result()

    def _push_collective(self, meta: WeightUpdateMeta) -> None:
        """Plan the buckets, start the servers' receive of the WHOLE plan, then broadcast bucket by bucket.

        The servers learn every bucket's specs up front (vLLM: in one RPC per server) and
        receive the broadcasts in plan order inside that call, so the trainer streams the
        buckets without a round trip between them.
        """
        plan = bucket_plan(self.engine.hf_param_specs(), meta.bucket_size_mb)
        sender = self._is_sender()
        future = None
        if sender:
            if self._weight_group is None:
                joined = self.client.init_weights_update_group(meta)
                self._weight_group = create_trainer_weight_group(
                    meta.group_addr, meta.group_port, meta.world_size, meta.comm_backend
                )
                joined.result()
            future = self.client.update_weights_from_distributed(meta, plan)
        params = self.engine.iter_hf_params()
        for bucket in plan:
            tensors = [next(params) for _ in bucket]
            if sender:
                flat, sent = pack_bucket(tensors)
                if sent != bucket:  # the servers unpack by the plan: a mismatch would load garbage
                    got = next(f"{a} != {b}" for a, b in zip(sent, bucket, strict=True) if a != b)
                    raise RuntimeError(f"push_weights: iter_hf_params disagrees with hf_param_specs: {got}")
                self._broadcast(flat.to(self._comm_device(meta)), future)
        if future is not None:
            future.result()

    def _broadcast(self, flat: torch.Tensor, servers: Future[None] | None) -> None:
        """Broadcast one bucket; fail at once (not after the group timeout) if the servers gave up.

        A server that rejects a weight (vLLM: a name its model lacks) still takes the rest of
        the update's broadcasts before its receive request fails, so ``future.result()`` reports
        it right after the last bucket. A request that fails before receiving everything (the
        server died or refused the call; or a per-bucket backend that stops sending requests)
        never joins the next broadcast: waiting on it would block until the group's timeout.
        """
        work = self._weight_group.broadcast(flat, 0)
        while not work.is_completed():
            failed = servers.exception() if servers is not None and servers.done() else None
            if failed is not None:
                self._weight_group = None  # the group is unusable now; the next update builds a new one
                raise failed
            time.sleep(0.002)
        work.wait()

    def _comm_device(self, meta: WeightUpdateMeta) -> torch.device:
        return self.engine.device if meta.comm_backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Close the weight-update group (rank 0 frees its store and port); the next push opens a new one."""
        group, self._weight_group = self._weight_group, None
        destroy_weight_group(group)
