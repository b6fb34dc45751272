"""Delta encoding of weight buckets against the last-sent copy, and the bucket checksum.

Pure torch on flat ``uint8`` buckets (``tandemrl.weights.wire``'s format,
whose length is a multiple of 64 bytes), on any device. The trainer encodes each bucket
against the copy it sent last; the server, holding the same copy, decodes in place and
checks the checksum of the result, so a mismatch is an error, never a silent corruption.

Encodings (the ``kind`` in each bucket's header):

* ``FULL``: the new bucket itself.
* ``XOR``: a bitmask of the 16-bit words that differ (``nbytes / 16`` bytes; bit ``i % 8`` of
  byte ``i // 8`` marks word ``i``), then ``new ^ old`` of those words in order: 2 bytes per
  changed word plus 1 bit per word.
* ``SPARSE``: ``k`` int32 indices of the 16-bit words that differ, then their ``k`` new
  16-bit values: 6 bytes per changed word, the smallest when under ~3% of the words change.

A 16-bit word is one bf16/fp16 element or half of an fp32 one.

Integers are little-endian as the device stores them (both ends run the same build).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tandemrl.api.inference import ParamSpec
from tandemrl.weights.wire import bucket_nbytes, unpack_bucket

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

FULL, XOR, SPARSE = 0, 1, 2
KINDS = {"none": FULL, "xor": XOR, "sparse": SPARSE}
HEADER_LEN = 4  # int64: kind, payload bytes, checksum word 1, checksum word 2
_CHUNK_WORDS = 1 << 21  # the checksum's position weights cover 16 MiB at a time
_PACK = 0x0102040810204080  # times 8 bytes of 0/1, the top byte holds them as bits 0..7


def _require_flat(flat: torch.Tensor, what: str) -> None:
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() % 64:
        raise ValueError(
            f"{what}: needs a 1-D uint8 tensor of a multiple of 64 bytes, got {flat.dtype} {tuple(flat.shape)}"
        )


def checksum(flat: torch.Tensor) -> tuple[int, int]:
    """(sum of w_i, sum of (i + 1) * w_i), both mod 2**64 as signed int64, over the int64 words w_i of ``flat``.

    The position weights catch moved as well as changed bytes.
    """
    import torch

    _require_flat(flat, "checksum")
    words = flat.view(torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    weights = torch.arange(1, min(words.numel(), _CHUNK_WORDS) + 1, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS]
        part = w.sum()
        s1 += part
        s2 += torch.dot(w, weights[: w.numel()]) + start * part
    return int(s1), int(s2)


def changed_elements(new: torch.Tensor, old: torch.Tensor, itemsizes: list[tuple[int, int, int]]) -> int:
    """Elements whose bits differ; ``itemsizes`` holds (byte offset, byte length, itemsize) per tensor."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    n = 0
    for offset, length, size in itemsizes:
        a, b = new[offset : offset + length].view(ints[size]), old[offset : offset + length].view(ints[size])
        n += int((a != b).sum())
    return n


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor (length a multiple of 64) as bits, ``mask[i]`` at bit ``i % 8`` of byte ``i // 8``."""
    import torch

    return ((mask.view(torch.uint8).view(torch.int64) * _PACK) >> 56).to(torch.uint8)


def _unpackbits(bits: torch.Tensor) -> torch.Tensor:
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits[:, None] >> shifts) & 1).view(-1).bool()


def encode(kind: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The payload turning ``old`` into ``new`` (equal-length flat buckets) with encoding ``kind``."""
    import torch

    _require_flat(new, "weight delta encode")
    if old.shape != new.shape or old.device != new.device:
        raise ValueError(f"weight delta encode: old bucket {tuple(old.shape)} does not match new {tuple(new.shape)}")
    if kind == FULL:
        return new
    if kind == XOR:
        x = new.view(torch.int16) ^ old.view(torch.int16)
        mask = x != 0
        return torch.cat([_packbits(mask), x[mask].view(torch.uint8)])
    if kind == SPARSE:
        if new.numel() // 2 >= 2**31:
            raise ValueError(f"weight delta encode: a {new.numel()}-byte bucket is too large for int32 indices")
        a, b = new.view(torch.int16), old.view(torch.int16)
        idx = (a != b).nonzero().view(-1)
        return torch.cat([idx.to(torch.int32).view(torch.uint8), a[idx].view(torch.uint8)])
    raise ValueError(f"weight delta: unknown encoding kind {kind}")


def decode_(kind: int, payload: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Apply ``payload`` (from ``encode(kind, new, base)``) to ``base`` in place; returns ``base``."""
    import torch

    _require_flat(base, "weight delta decode")
    n = base.numel()
    if kind == FULL:
        if payload.numel() != n:
            raise ValueError(f"weight delta decode: full payload has {payload.numel()} bytes, the bucket {n}")
        return base.copy_(payload)
    if kind == XOR:
        head = n // 16
        if payload.numel() < head or (payload.numel() - head) % 2:
            raise ValueError(f"weight delta decode: xor payload of {payload.numel()} bytes does not fit {n} bytes")
        mask = _unpackbits(payload[:head])
        values = payload[head:].view(torch.int16)
        if int(mask.sum()) != values.numel():
            raise ValueError(f"weight delta decode: xor mask marks {int(mask.sum())} words, {values.numel()} sent")
        words = base.view(torch.int16)
        words[mask.nonzero().view(-1)] ^= values
        return base
    if kind == SPARSE:
        if payload.numel() % 6:
            raise ValueError(f"weight delta decode: sparse payload of {payload.numel()} bytes is not 6 per word")
        k = payload.numel() // 6
        idx = payload[: 4 * k].view(torch.int32).to(torch.int64)
        if k and not 0 <= int(idx.min()) <= int(idx.max()) < n // 2:
            raise ValueError(f"weight delta decode: sparse index out of the bucket's {n // 2} words")
        base.view(torch.int16)[idx] = payload[4 * k :].view(torch.int16)
        return base
    raise ValueError(f"weight delta: unknown encoding kind {kind}")


# ------------------------------------------------------------------------------ wire


def header(kind: int, payload_nbytes: int, bucket_checksum: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The int64[4] broadcast before each bucket's payload."""
    import torch

    return torch.tensor([kind, payload_nbytes, *bucket_checksum], dtype=torch.int64, device=device)


def receive_delta_buckets(
    pg: ProcessGroup, buckets: list[list[ParamSpec]], device: torch.device | str, base: list[torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side of a delta update: per bucket a header, then its payload applied to ``base[b]``.

    ``base`` holds the flat buckets of the previous update (empty before the first anchor);
    it is updated in place and its tensors back the yielded views. Each rebuilt bucket's
    checksum must equal the header's, else a one-line error (and ``base`` is then stale:
    the caller drops it).
    """
    import torch

    names = {v: k for k, v in KINDS.items()} | {FULL: "full"}
    for b, specs in enumerate(buckets):
        head = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        pg.broadcast(head, 0).wait()
        kind, nbytes, c1, c2 = (int(v) for v in head.tolist())
        n = bucket_nbytes(specs)
        if kind == FULL:
            if nbytes != n:
                raise RuntimeError(f"weight delta: bucket {b} sent {nbytes} bytes whole, its specs describe {n}")
            if b == len(base):
                base.append(torch.empty(n, dtype=torch.uint8, device=device))
            elif base[b].numel() != n:
                base[b] = torch.empty(n, dtype=torch.uint8, device=device)
            pg.broadcast(base[b], 0).wait()  # the last update's views were loaded already
        else:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
            pg.broadcast(payload, 0).wait()
            if b >= len(base) or base[b].numel() != n:
                raise RuntimeError(f"weight delta: bucket {b} came as a delta but this server holds no base for it")
            decode_(kind, payload, base[b])
        got = checksum(base[b])
        if got != (c1, c2):
            raise RuntimeError(
                f"weight delta: bucket {b} ({names.get(kind, kind)}) checksum {got} != trainer's {(c1, c2)}"
            )
        yield from unpack_bucket(base[b], specs)
    del base[len(buckets) :]  # a new plan may have fewer buckets than the last one
