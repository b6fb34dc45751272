"""Ports for the sockets a run opens (torch stores, weight-update groups, servers); stdlib only."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` a moment ago ("" = every IPv4 interface; an IPv6 literal binds IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
