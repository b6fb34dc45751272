"""Rollout batches across trainer ranks: produced on each DP head, shared with its TP/PP peers,
then dealt over the DP ranks without splitting a prompt's group."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from tandemrl.api.engine import TrainBackend
from tandemrl.api.types import TensorDict
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.engines.packing import balanced_partition


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


def collect(engine: TrainBackend, produce: Callable[[], TensorDict], granularity: int | None) -> TensorDict:
    """This rank's share of a rollout batch; collective over every trainer rank.

    The head of each DP replica (every rank under FSDP/DeepSpeed) calls ``produce`` with its
    own client and prompts; its TP/PP peers receive that batch. With a ``granularity``, the
    groups are then dealt over the DP ranks (``redistribute``); with None each replica keeps
    its own batch (evaluation).
    """
    batch = produce() if engine.is_data_parallel_head() else None
    batch = engine.broadcast_in_model_parallel_group(batch)
    if granularity is not None and engine.data_parallel_world_size > 1:
        batch = redistribute(batch, granularity, engine.data_parallel_group)
    return batch
