"""Ports for the sockets a run opens (torch stores, weight-update groups, servers); stdlib only.

A port handed out here is bound later, often seconds later by another process (a server's start, a rank's
rendezvous). A port the kernel picks (``bind(port 0)``) comes from its ephemeral range, the same range it
gives outgoing connections their source ports from: with many connections open (HTTP clients, Ray's RPCs)
one of them can take the port in that gap, and the later bind fails with EADDRINUSE. So ports are drawn at
random from a band below the ephemeral range (and below torch's default rendezvous ports 29400/29500, above
Ray's default worker ports 10002-19999), where the kernel never assigns source ports; the kernel's pick
remains the fallback where the ephemeral range starts too low to leave such a band.
"""

from __future__ import annotations

import random
import socket

BAND = (20000, 29000)  # [low, high): below the usual ephemeral range (32768-60999 on Linux)
_TRIES = 64
_rng = random.SystemRandom()  # never the seeded global generator: seeded ranks would draw the same ports


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The kernel's (first, last) source port for outgoing connections, or None where it cannot be read."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return first, last


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` a moment ago ("" = every IPv4 interface; an IPv6 literal binds IPv6),
    outside the kernel's ephemeral range when that range leaves room for ``BAND`` (see the module doc)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    eph = ephemeral_range()
    if eph is not None and eph[0] >= BAND[1]:
        for _ in range(_TRIES):
            port = _rng.randrange(*BAND)
            if _bindable(family, host, port):
                return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_problem(port: int, host: str = "") -> str | None:
    """Why a server cannot listen on ``port`` at ``host`` (0 = a free one, always fine), else None: out of range,
    or taken now. Checked before a server starts, so a bad port is one line instead of a crash seconds later."""
    if not 0 <= port <= 65535:
        return f"must be 0 (a free one) or a port in 1-65535, got {port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port and not _bindable(family, host, port):
        return f"{port} is in use on {host or 'every interface'} (or may not be bound here); pick another or 0"
    return None


def address_problem(addr: str) -> str | None:
    """Why ``addr`` is not a server address ``host:port`` (port 1-65535; ``[v6]:port`` too), else None."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host.strip("[]"):
        return "is not host:port"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "has a port outside 1-65535"
    return None
