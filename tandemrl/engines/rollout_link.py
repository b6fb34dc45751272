"""The trainer's side of rollout: distributed batch collection and weight updates.

Written once for every backend. A backend only provides ``iter_hf_params`` (collective:
full HF-named tensors, one at a time) and ``hf_param_specs`` (names, shapes, dtypes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from tandemrl.api.inference import ParamSpec, WeightUpdateMeta
from tandemrl.api.types import SaveLoadMeta, TensorDict
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.engines.packing import balanced_partition

if TYPE_CHECKING:
    from tandemrl.engines.base import BaseTrainEngine


class RolloutClient(Protocol):
    """What the trainer needs of an inference client (RemoteInfEngine implements it)."""

    def rollout_batch(self, data: list[dict[str, Any]], workflow: Any, should_accept_fn: Any = None) -> TensorDict: ...

    def prepare_batch(self, dataloader: Any, workflow: Any, should_accept_fn: Any = None) -> TensorDict: ...

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Any: ...

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Any: ...

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs: list[list[ParamSpec]]) -> Any:
        """Start the servers' receive of every bucket (one request per server where the backend allows)."""
        ...


def split_groups(batch: TensorDict, granularity: int) -> list[TensorDict]:
    """Cut a padded batch into chunks of ``granularity`` rows, each trimmed to its own length."""
    bsz = batch["attention_mask"].shape[0]
    if bsz % granularity:
        raise ValueError(f"rollout batch of {bsz} sequences is not a multiple of granularity {granularity}")
    chunks = []
    for i in range(0, bsz, granularity):
        mask = batch["attention_mask"][i : i + granularity]
        length = int(mask.sum(1).max())
        seq_len = mask.shape[1]
        chunk = {}
        for k, v in batch.items():
            v = v[i : i + granularity]
            chunk[k] = v[:, :length] if v.dim() >= 2 and v.shape[1] == seq_len else v
        chunks.append(chunk)
    return chunks


def redistribute(batch: TensorDict, granularity: int, group: dist.ProcessGroup | None) -> TensorDict:
    """Gather every DP rank's rollouts and deal them back balanced by tokens.

    A chunk of ``granularity`` sequences (one prompt's group) never splits across ranks,
    so group-normalized advantages can be computed locally.
    """
    world = dist.get_world_size(group)
    chunks = split_groups(batch, granularity)
    gathered: list[list[TensorDict]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, chunks, group=group)
    everything = [c for rank_chunks in gathered for c in rank_chunks]
    if len(everything) < world:
        raise ValueError(f"{len(everything)} rollout groups cannot be spread over {world} data-parallel ranks")
    tokens = [int(c["attention_mask"].sum()) for c in everything]
    parts = balanced_partition(tokens, world)
    mine = parts[dist.get_rank(group)]
    return concat_padded_tensors([everything[i] for i in mine])


class RolloutLink:
    """Connects one training engine to an inference client."""

    def __init__(self, engine: BaseTrainEngine, rollout: RolloutClient, meta: WeightUpdateMeta | None):
        self.engine = engine
        self.rollout = rollout
        self.meta = meta
        self._weight_group: Any = None

    # --------------------------------------------------------------- batches
    def _collect(self, produce: Callable[[], TensorDict], granularity: int) -> TensorDict:
        # The head of every DP replica produces from its own client and prompts (every rank under
        # FSDP/DeepSpeed); its TP/PP peers receive that batch; then groups are dealt over DP ranks.
        eng = self.engine
        batch = produce() if eng.is_data_parallel_head() else None
        batch = eng.broadcast_in_model_parallel_group(batch)
        if eng.data_parallel_world_size > 1:
            batch = redistribute(batch, granularity, eng.data_parallel_group)
        return batch

    def rollout_batch(
        self, data: list[dict[str, Any]], workflow: Any, should_accept_fn: Any = None, granularity: int = 1
    ) -> TensorDict:
        return self._collect(lambda: self.rollout.rollout_batch(data, workflow, should_accept_fn), granularity)

    def prepare_batch(
        self, dataloader: Any, workflow: Any, should_accept_fn: Any = None, granularity: int = 1
    ) -> TensorDict:
        return self._collect(lambda: self.rollout.prepare_batch(dataloader, workflow, should_accept_fn), granularity)

    # --------------------------------------------------------------- weights
    def update_weights(self, meta: WeightUpdateMeta | None = None) -> None:
        """Push the current weights to every server; collective over all trainer ranks."""
        meta = meta or self.meta
        if meta is None:
            raise ValueError("update_weights: no WeightUpdateMeta (pass one here or to connect_engine)")
        if meta.version is None:
            meta = meta.with_version(self.engine.get_version() + 1)
        if meta.type == "disk":
            self._update_from_disk(meta)
        elif meta.type == "collective":
            self._update_collective(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type: unknown type '{meta.type}' (disk or collective)")
        dist.barrier()

    def _is_sender(self) -> bool:
        return dist.get_rank() == 0

    def _update_from_disk(self, meta: WeightUpdateMeta) -> None:
        assert meta.path is not None
        self.engine.save(SaveLoadMeta(path=meta.path, weight_format="hf"))
        if self._is_sender():
            self.rollout.update_weights_from_disk(meta).result()

    def _update_collective(self, meta: WeightUpdateMeta) -> None:
        """Plan the buckets, start the servers' receive of the WHOLE plan, then broadcast bucket by bucket.

        The servers learn every bucket's specs up front (vLLM: in one RPC per server) and
        receive the broadcasts in plan order inside that call, so the trainer streams the
        buckets without a round trip between them.
        """
        from tandemrl.inference.weight_group import create_trainer_weight_group, pack_bucket, split_buckets

        specs = self.engine.hf_param_specs()
        fake = ((s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta")) for s in specs)
        plan = [
            [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b]
            for b in split_buckets(fake, meta.bucket_size_mb << 20)
        ]
        sender = self._is_sender()
        future = None
        if sender:
            if self._weight_group is None:
                joined = self.rollout.init_weights_update_group(meta)
                self._weight_group = create_trainer_weight_group(
                    meta.group_addr, meta.group_port, meta.world_size, meta.comm_backend
                )
                joined.result()
            future = self.rollout.update_weights_from_distributed(meta, plan)
        params = self.engine.iter_hf_params()
        for bucket in plan:
            tensors = [next(params) for _ in bucket]
            if sender:
                flat, sent = pack_bucket(tensors)
                if sent != bucket:  # the servers unpack by the plan: a mismatch would load garbage
                    got = next(f"{a} != {b}" for a, b in zip(sent, bucket, strict=True) if a != b)
                    raise RuntimeError(f"update_weights: iter_hf_params disagrees with hf_param_specs: {got}")
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

    def destroy(self) -> None:
        if self._weight_group is not None:
            from tandemrl.inference.weight_group import destroy_weight_group

            destroy_weight_group(self._weight_group)
            self._weight_group = None
