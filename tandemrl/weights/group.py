"""The weight-update process group: trainer rank 0 hosts it, every inference worker joins it.

Pure torch (no vllm), imported lazily: the trainer's pusher (``tandemrl.weights.push``) hosts
the group, the vLLM worker extension (``tandemrl.inference.vllm_ext``) joins it, and both
speak ``tandemrl.weights.wire`` over it.

The trainer head is rank 0 and hosts a ``TCPStore`` at ``host:port``; every inference worker
connects to it as rank ``1..world_size-1``. Keys live under ``PrefixStore(tcp_prefix(host,
port), store)`` -- the same prefix vLLM's ``stateless_init_torch_distributed_process_group``
uses -- and the group is a stateless gloo/nccl ``ProcessGroup`` that never touches the
default group (vLLM workers already have one). All ranks block in the constructor until
everyone has joined, so the trainer must fire the servers' "join" requests (in a background
thread) before calling ``host_group``.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DEFAULT_TIMEOUT_S = 600.0


def tcp_prefix(host: str, port: int) -> str:
    """The PrefixStore prefix both sides use (vLLM's ``get_tcp_uri``)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def host_group(
    host: str, port: int, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroup:
    """Rank 0 of the weight-update group: host the store, wait for every server rank to join."""
    return _init_group(host, port, 0, world_size, backend, timeout_s)


def join_group(
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


def destroy_group(pg: ProcessGroup | None) -> None:
    """Best-effort shutdown; the peer may already be gone."""
    if pg is None:
        return
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - a dead peer must not break cleanup
        pass
