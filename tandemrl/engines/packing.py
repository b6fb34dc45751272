"""Padded <-> packed batches and token-balanced micro-batches.

Engines take padded batches ([B, L] tensors plus a bool ``attention_mask``) and run
the model on packed micro-batches: every per-token field becomes 1-D over the
micro-batch's tokens, ``cu_seqlens`` marks sequence starts and ``position_ids``
restart at 0 for every sequence, so attention never crosses a boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandemrl.api.types import TensorDict


def _is_per_token(value: torch.Tensor, batch_size: int, seq_len: int) -> bool:
    return value.dim() >= 2 and value.shape[0] == batch_size and value.shape[1] == seq_len


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Lengths of the right-padded sequences of a padded batch."""
    if "attention_mask" not in batch:
        raise KeyError("batch has no 'attention_mask'; padded batches need one")
    return batch["attention_mask"].bool().sum(dim=1)


def pack_sequences(batch: TensorDict, indices: Sequence[int]) -> TensorDict:
    """Pack the sequences ``indices`` of a padded batch into one 1-D micro-batch.

    Per-token fields ([B, L, ...]) are concatenated without padding; per-sequence fields
    ([B, ...]) are indexed. Adds ``cu_seqlens`` (int32, [n+1]), ``position_ids`` and
    ``max_seqlen`` (0-dim).
    """
    mask = batch["attention_mask"].bool()
    bsz, seq_len = mask.shape
    idx = torch.as_tensor(list(indices), dtype=torch.long)
    lens = mask[idx].sum(dim=1)
    flat_mask = mask[idx]
    out: TensorDict = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if _is_per_token(value, bsz, seq_len):
            out[key] = value[idx][flat_mask]
        elif value.dim() >= 1 and value.shape[0] == bsz:
            out[key] = value[idx]
        else:
            raise ValueError(f"batch field '{key}' of shape {tuple(value.shape)} is neither per-token nor per-sequence")
    cu = torch.zeros(len(idx) + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lens, dim=0)
    out["cu_seqlens"] = cu
    out["position_ids"] = torch.cat([torch.arange(int(n), device=mask.device) for n in lens])
    out["max_seqlen"] = lens.max() if len(lens) else torch.tensor(0)
    return out


def balanced_partition(weights: Sequence[int], k: int) -> list[list[int]]:
    """Split items into ``k`` groups with near-equal weight sums (largest-first greedy).

    Items keep their original order inside each group; empty groups are dropped.
    """
    groups: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        g = min(range(k), key=lambda j: (sums[j], j))
        groups[g].append(i)
        sums[g] += weights[i]
    return [sorted(g) for g in groups if g]


def plan_micro_batches(lengths: Sequence[int], n_mbs: int = 1, max_tokens_per_mb: int | None = None) -> list[list[int]]:
    """Group sequence indices into micro-batches.

    At least ``n_mbs`` groups; more when needed so that no group exceeds
    ``max_tokens_per_mb`` tokens (a single longer sequence gets a group of its own).
    """
    n = len(lengths)
    if n == 0:
        return []
    if max_tokens_per_mb is not None and max(lengths) > max_tokens_per_mb:
        # A sequence cannot be split: it gets its own micro-batch, over budget.
        budget: int | None = max(lengths)
    else:
        budget = max_tokens_per_mb
    k = min(n, max(1, n_mbs))
    if budget is not None:
        k = max(k, -(-sum(lengths) // budget))
    while True:
        groups = balanced_partition(lengths, min(k, n))
        if budget is None or all(sum(lengths[i] for i in g) <= budget for g in groups) or k >= n:
            return groups
        k += 1


@dataclass
class MicroBatches:
    """Packed micro-batches of one padded batch and where each sequence went."""

    mbs: list[TensorDict]
    groups: list[list[int]]
    batch_size: int
    seq_len: int


def plan_padded_batch(
    batch: TensorDict, n_mbs: int = 1, max_tokens_per_mb: int | None = None, granularity: int = 1
) -> list[list[int]]:
    """Sequence indices of each micro-batch of a padded batch.

    ``granularity`` keeps runs of that many consecutive sequences (e.g. a GRPO group)
    in the same micro-batch.
    """
    lens = sequence_lengths(batch).tolist()
    bsz = len(lens)
    if bsz % granularity != 0:
        raise ValueError(f"batch size {bsz} is not a multiple of granularity {granularity}")
    chunks = [range(i, i + granularity) for i in range(0, bsz, granularity)]
    return plan_chunks(chunks, [sum(lens[i] for i in c) for c in chunks], n_mbs, max_tokens_per_mb)


def plan_chunks(
    chunks: Sequence[Sequence[int]], tokens: Sequence[int], n_mbs: int = 1, max_tokens_per_mb: int | None = None
) -> list[list[int]]:
    """Sequence indices of each micro-batch when ``chunks`` (index runs of ``tokens`` tokens each) stay whole."""
    return [[i for c in g for i in chunks[c]] for g in plan_micro_batches(tokens, n_mbs, max_tokens_per_mb)]


def pack_groups(batch: TensorDict, groups: list[list[int]], n_total: int | None = None) -> MicroBatches:
    """Pack each group into a micro-batch; pad the list to ``n_total`` with dummy micro-batches.

    Dummy micro-batches (empty group) repeat the first sequence so every rank runs the
    same number of forward/backward passes, which sharded backends need for their
    collectives; callers give them zero loss weight and drop their outputs.
    """
    groups = list(groups)
    while n_total is not None and len(groups) < n_total:
        groups.append([])
    mbs = [pack_sequences(batch, g if g else [0]) for g in groups]
    bsz, seq_len = batch["attention_mask"].shape
    return MicroBatches(mbs=mbs, groups=groups, batch_size=bsz, seq_len=seq_len)


def split_padded_batch(
    batch: TensorDict, n_mbs: int = 1, max_tokens_per_mb: int | None = None, granularity: int = 1
) -> MicroBatches:
    """Pack a padded batch into token-balanced micro-batches (see :func:`plan_padded_batch`)."""
    return pack_groups(batch, plan_padded_batch(batch, n_mbs, max_tokens_per_mb, granularity))


def unpack_to_padded(
    values: Sequence[torch.Tensor], mbs: MicroBatches, attention_mask: torch.Tensor, pad_value: float = 0.0
) -> torch.Tensor:
    """Scatter per-token outputs of each packed micro-batch back to the padded [B, L] layout."""
    first = values[0]
    out = torch.full((mbs.batch_size, mbs.seq_len, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
    mask = attention_mask.bool().to(first.device)
    for vals, group in zip(values, mbs.groups, strict=True):
        if not group:
            continue
        idx = torch.as_tensor(group, dtype=torch.long, device=first.device)
        sub = out[idx]
        sub[mask[idx]] = vals
        out[idx] = sub
    return out
