"""Weight-update process group and the bucket wire format shared by trainer and inference workers.

Pure torch (no vllm): the trainer engine imports this to broadcast, the vLLM worker
extension (``tandemrl.inference.vllm_ext``) imports it to receive, so both sides agree by
construction.

Rendezvous
    The trainer head is rank 0 and hosts a ``TCPStore`` at ``host:port``; every inference
    worker connects to it as rank ``1..world_size-1``. Keys live under
    ``PrefixStore(tcp_prefix(host, port), store)`` -- the same prefix vLLM's
    ``stateless_init_torch_distributed_process_group`` uses -- and the group is a
    stateless gloo/nccl ``ProcessGroup`` that never touches the default group (vLLM
    workers already have one). All ranks block in the constructor until everyone has
    joined, so the trainer must fire the servers' "join" requests (in a background
    thread) before calling ``create_trainer_weight_group``.

Bucket wire format (one broadcast per bucket)
    A bucket is an ordered list of ``ParamSpec(name, shape, dtype)``; ``dtype`` is the
    torch name without "torch." (``"bfloat16"``). Its tensors are laid out back to back in
    ONE flat ``torch.uint8`` tensor, each starting at a byte offset rounded up to
    ``ALIGN`` (64) bytes, in bucket order; the flat tensor is ``bucket_nbytes(specs)``
    long. Rank 0 broadcasts it once (``pg.broadcast(flat, 0)``), and receivers rebuild
    the named tensors with ``unpack_bucket``. The metadata travels as JSON:
    ``[[[name, dtype, [d0, d1, ...]], ...], ...]`` (a list of buckets) or, for one
    bucket, ``[[name, dtype, shape], ...]``; ``parse_buckets_json`` accepts both.
    Buckets never split one decoder layer (``split_buckets``), so a server may load each
    bucket on its own without seeing half of a fused (e.g. qkv) layer.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from tandemrl.api.inference import ParamSpec

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

ALIGN = 64  # byte alignment of every tensor inside a bucket (any dtype can be viewed in place)
DEFAULT_TIMEOUT_S = 600.0
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")


# ---------------------------------------------------------------------------------- group


def tcp_prefix(host: str, port: int) -> str:
    """The PrefixStore prefix both sides use (vLLM's ``get_tcp_uri``)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def create_trainer_weight_group(
    host: str, port: int, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroup:
    """Rank 0 of the weight-update group: host the store, wait for every server rank to join."""
    return _init_group(host, port, 0, world_size, backend, timeout_s)


def join_weight_group(
    host: str, port: int, world_size: int, rank: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroup:
    """A server-side rank (>= 1) of the group rank 0 hosts at ``host:port``."""
    if not 1 <= rank < world_size:
        raise ValueError(f"weight group rank {rank} must be in 1..{world_size - 1} (rank 0 is the trainer)")
    return _init_group(host, port, rank, world_size, backend, timeout_s)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` only; a port in use is a one-line error naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A reconnect reuses the port of the group just closed, whose connections may sit in TIME_WAIT;
    # a port with a live listener still fails to bind.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"weight-update group: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> ProcessGroup:
    import torch
    from torch.distributed import PrefixStore, ProcessGroup, TCPStore

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    if world_size < 2:
        raise ValueError(f"weight group world_size must be >= 2, got {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        # TCPStore's own server listens on every interface; hand it a socket bound to ``host`` only
        # (loopback on one node), so nothing off this host can join the weight-update group.
        fd = _listen(host, int(port)).detach()  # the store owns the descriptor from here on
        store = TCPStore(host, int(port), world_size, is_master=True, timeout=timeout, master_listen_fd=fd)
    else:
        store = TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    prefix_store = PrefixStore(tcp_prefix(host, port), store)
    pg = ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        impl: Any = ProcessGroupGloo(prefix_store, rank, world_size, timeout=timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        impl = ProcessGroupNCCL(prefix_store, rank, world_size, opts)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    # A ProcessGroup shell around one backend, as torch's init_process_group builds it,
    # but without registering anything globally.
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


def destroy_weight_group(pg: ProcessGroup | None) -> None:
    """Best-effort shutdown; the peer may already be gone."""
    if pg is None:
        return
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - a dead peer must not break cleanup
        pass


# --------------------------------------------------------------------------------- buckets


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


def pack_bucket(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[ParamSpec]]:
    """One flat uint8 tensor (on the first tensor's device) holding ``tensors`` + their specs."""
    import torch

    items = list(tensors)
    if not items:
        raise ValueError("pack_bucket got no tensors")
    specs = [ParamSpec(name, tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for name, t in items]
    flat = torch.empty(bucket_nbytes(specs), dtype=torch.uint8, device=items[0][1].device)
    end = 0
    for (name, t), (offset, n) in zip(items, bucket_layout(specs), strict=True):
        if t.device != flat.device:
            raise ValueError(f"pack_bucket: tensor {name!r} is on {t.device}, the bucket on {flat.device}")
        flat[end:offset].zero_()  # only the alignment padding: one write per byte, not two
        flat[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
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
    pg: ProcessGroup, buckets: list[list[ParamSpec]], device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: lazily receive each bucket and yield its named tensors."""
    import torch

    for specs in buckets:
        flat = torch.empty(bucket_nbytes(specs), dtype=torch.uint8, device=device)
        pg.broadcast(flat, 0).wait()
        yield from unpack_bucket(flat, specs)
