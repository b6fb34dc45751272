"""Group-shared prefix layout: rows that start with the same tokens run that prefix once.

The G samples of a GRPO group share their prompt. In the shared layout a *segment* (consecutive
rows with a common prefix of P tokens) becomes one prefix block (positions 0..P-1) followed by
one suffix block per row (positions P..len-1). A suffix block attends to its prefix block and
causally to itself, never to the other suffixes, so every token sees exactly the tokens it sees
in the unshared layout and outputs are equal in exact arithmetic; the prefix's activations
receive the sum of the rows' gradients.

Segments come from the token ids themselves (no group ids needed): equal leading tokens are
exactly the condition under which sharing is exact. :func:`prefix_segments` groups rows,
:func:`build_shared_layout` lays out one packed micro-batch, and per-token outputs return to
the unshared packed layout with ``x.index_select(0, layout.index)`` (:func:`unshare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandemrl.api.types import TensorDict

PREFIX_SHARING_MODES = ("auto", "on", "off")
# auto shares when the shared layout has at most this fraction of the batch's tokens.
AUTO_MAX_TOKEN_RATIO = 0.9
# Per-sequence fields added to a batch before packing (see tandemrl.engines.packing).
SEGMENT_ID = "prefix_segment"  # rows with the same id (consecutive) share their first PREFIX_LEN tokens
PREFIX_LEN = "prefix_len"
# Fields of a packed micro-batch in the shared layout (from :func:`add_shared_layout`).
SHARED_KEYS = ("shared_input_ids", "shared_position_ids", "shared_index", "shared_block_cu", "shared_block_prefix")


@dataclass(frozen=True)
class Segment:
    """Rows ``start..end-1`` of a padded batch, sharing their first ``prefix_len`` tokens."""

    start: int
    end: int
    prefix_len: int
    tokens: int  # tokens of the segment in the shared layout


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of equal leading entries of two 1-D tensors."""
    n = min(len(a), len(b))
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def prefix_segments(input_ids: torch.Tensor, lengths: Sequence[int], max_tokens: int | None = None) -> list[Segment]:
    """Group consecutive rows of a right-padded [B, L] batch into prefix-sharing segments.

    A row joins the current segment of n rows (common prefix P) when the new common prefix P'
    saves tokens overall (``n * P' > (n - 1) * P``) and the segment stays within ``max_tokens``;
    e.g. the samples of one GRPO group join, the next group (sharing only a system prompt) does not.
    A segment of one row has ``prefix_len`` 0 (nothing shared).
    """
    segs: list[Segment] = []
    start, prefix, total = 0, 0, 0
    for r, n_tok in enumerate(lengths):
        if r > start:
            n = r - start
            first = prefix if n > 1 else lengths[start]
            p = min(first, common_prefix_len(input_ids[start, : lengths[start]], input_ids[r, :n_tok]))
            joined = p + sum(lengths[start : r + 1]) - (n + 1) * p
            if p > 0 and n * p > (n - 1) * first and (max_tokens is None or joined <= max_tokens):
                prefix, total = p, joined
                continue
            segs.append(Segment(start, r, prefix if r - start > 1 else 0, total))
        start, prefix, total = r, 0, n_tok
    if lengths:
        segs.append(Segment(start, len(lengths), prefix if len(lengths) - start > 1 else 0, total))
    return segs


def sharing_segments(batch: TensorDict, mode: str, max_tokens: int | None = None) -> list[Segment] | None:
    """Segments of a padded batch for ``mode`` ("on": always; "auto": when they save enough tokens)."""
    lengths = batch["attention_mask"].bool().sum(dim=1).tolist()
    segs = prefix_segments(batch["input_ids"], lengths, max_tokens)
    if mode == "auto" and sum(s.tokens for s in segs) > AUTO_MAX_TOKEN_RATIO * sum(lengths):
        return None
    return segs


def segment_fields(segs: Sequence[Segment], device: torch.device | None = None) -> TensorDict:
    """Per-row ``SEGMENT_ID`` and ``PREFIX_LEN`` [B] of a batch cut into ``segs``."""
    ids = torch.cat([torch.full((s.end - s.start,), i, dtype=torch.long) for i, s in enumerate(segs)])
    lens = torch.cat([torch.full((s.end - s.start,), s.prefix_len, dtype=torch.long) for s in segs])
    return {SEGMENT_ID: ids.to(device), PREFIX_LEN: lens.to(device)}


@dataclass(frozen=True)
class SharedLayout:
    """One packed micro-batch in the shared layout.

    ``block_cu`` [n_blocks + 1] bounds the blocks of the shared row; ``block_prefix`` [n_blocks]
    is the index of the prefix block a suffix block continues, -1 for a block that attends only
    causally to itself. ``index`` [T] is the shared row of every token of the unshared packing.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    block_cu: torch.Tensor
    block_prefix: torch.Tensor


def build_shared_layout(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, segment_id: torch.Tensor, prefix_len: torch.Tensor
) -> SharedLayout:
    """The shared layout of a packed micro-batch whose sequences carry ``segment_id``/``prefix_len``.

    Sequences of one segment must be consecutive and really share ``prefix_len`` leading tokens.
    """
    bounds = [int(b) for b in cu_seqlens.tolist()]
    seg, plen = segment_id.tolist(), prefix_len.tolist()
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    index: list[torch.Tensor] = []
    cu, parent = [0], []
    prefix_block, prefix_at, current = -1, 0, None

    def add_block(tokens: torch.Tensor, first_pos: int, of: int) -> int:
        ids.append(tokens)
        pos.append(torch.arange(first_pos, first_pos + len(tokens)))
        cu.append(cu[-1] + len(tokens))
        parent.append(of)
        return cu[-2]

    for i, (s, e) in enumerate(zip(bounds, bounds[1:], strict=False)):
        seq, p = input_ids[s:e], int(plen[i])
        if p <= 0:  # not shared: one causal block
            index.append(torch.arange(len(seq)) + add_block(seq, 0, -1))
            current = None
            continue
        if p > len(seq):
            raise ValueError(f"prefix_len {p} exceeds sequence {i}'s {len(seq)} tokens")
        if seg[i] != current:  # first row of a segment: its prefix becomes the shared block
            current, prefix_block = seg[i], len(parent)
            prefix_at = add_block(seq[:p], 0, -1)
        elif not torch.equal(ids[prefix_block], seq[:p]):
            raise ValueError(f"sequence {i} does not start with its segment's {p}-token prefix")
        # A row equal to its prefix adds no suffix block.
        own = torch.arange(len(seq) - p) + (add_block(seq[p:], p, prefix_block) if len(seq) > p else 0)
        index.append(torch.cat([torch.arange(p) + prefix_at, own]))
    device = input_ids.device
    return SharedLayout(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(pos).to(device),
        index=torch.cat(index).to(device),
        block_cu=torch.tensor(cu, dtype=torch.int32, device=device),
        block_prefix=torch.tensor(parent, dtype=torch.long, device=device),
    )


def add_shared_layout(mb: TensorDict) -> TensorDict:
    """``mb`` plus the ``SHARED_KEYS`` fields of its shared layout (from its per-sequence segment fields)."""
    lay = build_shared_layout(mb["input_ids"], mb["cu_seqlens"], mb[SEGMENT_ID], mb[PREFIX_LEN])
    values = (lay.input_ids, lay.position_ids, lay.index, lay.block_cu, lay.block_prefix)
    return {**mb, **dict(zip(SHARED_KEYS, values, strict=True))}


def unshare(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token outputs [T_shared, ...] -> the unshared packed layout [T, ...] (differentiable)."""
    return x.index_select(0, index)
