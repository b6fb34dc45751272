"""The bucket wire format trainer and inference workers share: one flat broadcast per bucket.

Pure torch (no vllm), imported lazily: the trainer's pusher (``tandemrl.weights.push``) packs
and broadcasts, the vLLM worker extension (``tandemrl.inference.vllm_ext``) receives and
unpacks, so both sides agree by construction.

A bucket is an ordered list of ``ParamSpec(name, shape, dtype)``; ``dtype`` is the torch name
without "torch." (``"bfloat16"``). Its tensors are laid out back to back in ONE flat
``torch.uint8`` tensor, each starting at a byte offset rounded up to ``ALIGN`` (64) bytes, in
bucket order; the flat tensor is ``bucket_nbytes(specs)`` long. Rank 0 broadcasts it once
(``pg.broadcast(flat, 0)``, over the ``tandemrl.weights.group`` group), and receivers rebuild
the named tensors with ``unpack_bucket``. The metadata travels as JSON:
``[[[name, dtype, [d0, d1, ...]], ...], ...]`` (a list of buckets) or, for one bucket,
``[[name, dtype, shape], ...]``; ``parse_buckets_json`` accepts both. Buckets never split one
decoder layer (``split_buckets``), so a server may load each bucket on its own without seeing
half of a fused (e.g. qkv) layer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from tandemrl.api.inference import ParamSpec

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

ALIGN = 64  # byte alignment of every tensor inside a bucket (any dtype can be viewed in place)
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str, where: str = "dtype") -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown torch dtype {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(spec: ParamSpec) -> int:
    numel = 1
    for d in spec.shape:
        numel *= int(d)
    return numel * to_dtype(spec.dtype, spec.name).itemsize


def bucket_layout(specs: list[ParamSpec]) -> list[tuple[int, int]]:
    """(byte offset, byte length) of each spec inside the flat bucket."""
    out, offset = [], 0
    for spec in specs:
        n = _nbytes(spec)
        out.append((offset, n))
        offset = _aligned(offset + n)
    return out


def bucket_nbytes(specs: list[ParamSpec]) -> int:
    if not specs:
        return 0
    offset, n = bucket_layout(specs)[-1]
    return _aligned(offset + n)


def pack_bucket(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[ParamSpec]]:
    """One flat uint8 tensor holding ``tensors`` + their specs.

    ``dtype``: floating-point tensors are cast to it as they are copied in (one pass, no cast copy).
    ``out``: a 1-D uint8 tensor of exactly the bucket's bytes to pack into, on any device (a buffer
    reused across updates: no fresh allocation to fault in); else a new one on the first tensor's device.
    """
    import torch

    items = list(tensors)
    if not items:
        raise ValueError("pack_bucket got no tensors")
    cast = [dtype if dtype is not None and t.is_floating_point() else t.dtype for _, t in items]
    specs = [
        ParamSpec(name, tuple(int(d) for d in t.shape), dtype_name(c)) for (name, t), c in zip(items, cast, strict=True)
    ]
    size = bucket_nbytes(specs)
    if out is None:
        flat = torch.empty(size, dtype=torch.uint8, device=items[0][1].device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != size:
        raise ValueError(
            f"pack_bucket: out must be a 1-D uint8 tensor of {size} bytes, got {out.dtype} {tuple(out.shape)}"
        )
    else:
        flat = out
    end = 0
    for (name, t), c, (offset, n) in zip(items, cast, bucket_layout(specs), strict=True):
        if out is None and t.device != flat.device:
            raise ValueError(f"pack_bucket: tensor {name!r} is on {t.device}, the bucket on {flat.device}")
        flat[end:offset].zero_()  # only the alignment padding: one write per byte, not two
        flat[offset : offset + n].view(c).copy_(t.detach().reshape(-1))
        end = offset + n
    flat[end:].zero_()
    return flat, specs


def unpack_bucket(flat: torch.Tensor, specs: list[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """Named tensors viewing ``flat`` (no copy); inverse of ``pack_bucket``."""
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"unpack_bucket needs a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    if flat.numel() != bucket_nbytes(specs):
        raise ValueError(f"unpack_bucket: bucket has {flat.numel()} bytes, its specs describe {bucket_nbytes(specs)}")
    out = []
    for spec, (offset, n) in zip(specs, bucket_layout(specs), strict=True):
        t = flat[offset : offset + n].view(to_dtype(spec.dtype, spec.name)).view(spec.shape)
        out.append((spec.name, t))
    return out


def layer_key(name: str) -> str:
    """Parameters sharing a key stay in one bucket (a decoder layer, else the name itself)."""
    m = _LAYER_RE.match(name)
    return m.group(1) if m else name


def split_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of about ``bucket_bytes``, cutting only between layers.

    A layer larger than ``bucket_bytes`` becomes one oversized bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    group: list[tuple[str, torch.Tensor]] = []
    size = group_size = 0
    key: str | None = None
    for name, t in named_tensors:
        k = layer_key(name)
        if k != key and group:
            if bucket and size + group_size > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket += group
            size += group_size
            group, group_size = [], 0
        key = k
        group.append((name, t))
        group_size += _aligned(t.numel() * t.element_size())
    if group:
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket = []
        bucket += group
    if bucket:
        yield bucket


def buckets_to_json(buckets: list[list[ParamSpec]]) -> str:
    return json.dumps([[[s.name, s.dtype, list(s.shape)] for s in b] for b in buckets])


def parse_buckets_json(meta_json: str) -> list[list[ParamSpec]]:
    """Buckets from the JSON metadata (a list of buckets, or one bucket); one-line errors."""
    try:
        raw = json.loads(meta_json)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"weight bucket meta_json is not valid JSON: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError("weight bucket meta_json must be a non-empty list")
    single = isinstance(raw[0], list) and bool(raw[0]) and isinstance(raw[0][0], str)
    buckets = [raw] if single else raw
    out: list[list[ParamSpec]] = []
    for b, bucket in enumerate(buckets):
        if not isinstance(bucket, list) or not bucket:
            raise ValueError(f"weight bucket meta_json: bucket {b} must be a non-empty list")
        specs = []
        for i, entry in enumerate(bucket):
            ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            ok = ok and isinstance(entry[1], str) and isinstance(entry[2], list)
            if not ok or not all(isinstance(d, int) and d >= 0 for d in entry[2]):
                raise ValueError(f"weight bucket meta_json: bucket {b} entry {i} must be [name, dtype, shape]")
            to_dtype(entry[1], entry[0])
            specs.append(ParamSpec(entry[0], tuple(entry[2]), entry[1]))
        out.append(specs)
    return out


def broadcast_buckets(pg: ProcessGroup, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
    """Trainer side: pack and broadcast each bucket from rank 0, in order."""
    for bucket in buckets:
        flat, _ = pack_bucket(bucket)
        pg.broadcast(flat, 0).wait()


def receive_buckets(
    pg: ProcessGroup,
    buckets: list[list[ParamSpec]],
    device: torch.device | str,
    buffers: list[torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: lazily receive each bucket and yield its named tensors.

    ``buffers``: bucket ``i`` is received into ``buffers[i]`` when its size matches (else a new
    tensor is put there), so an update reuses the last one's memory. The yielded tensors view it:
    the caller must be done with them before the next update.
    """
    import torch

    for i, specs in enumerate(buckets):
        size = bucket_nbytes(specs)
        if buffers is not None and i < len(buffers) and buffers[i].numel() == size:
            flat = buffers[i]
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            if buffers is not None:
                del buffers[i:]
                buffers.append(flat)
        pg.broadcast(flat, 0).wait()
        yield from unpack_bucket(flat, specs)
