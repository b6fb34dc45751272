"""Which inference servers a client talks to: their addresses, which one takes a request, which are dead.

``parse_server_addrs`` checks a ``host:port`` list (from the config, the launcher's
``TANDEMRL_LLM_SERVER_ADDRS`` or a caller); ``ServerPool`` routes requests (sticky per request id,
otherwise round-robin) and remembers dead servers; ``ServerUnavailableError`` is raised when none is
left. ``tandemrl.inference.remote`` (the client) and ``tandemrl.inference.weight_calls`` use them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

logger = logging.getLogger(__name__)

SERVER_ADDRS_ENV = "TANDEMRL_LLM_SERVER_ADDRS"  # comma-separated host:port list the launcher exports


class ServerUnavailableError(RuntimeError):
    """No inference server can take the call (none healthy at setup, or all marked dead)."""


def parse_server_addrs(addrs: list[str], source: str) -> list[str]:
    """``addrs`` after checking each is ``host:port``; the one-line error names ``source``."""
    out: list[str] = []
    for raw in addrs:
        addr = str(raw).strip()
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{source}: bad inference server address {raw!r} (expected host:port)")
        if addr in out:
            raise ValueError(f"{source}: inference server {addr!r} is listed twice")
        out.append(addr)
    return out


class ServerPool:
    """Which server a request goes to, and which servers are dead (thread-safe)."""

    def __init__(self, addrs: list[str], max_sticky: int = 100_000) -> None:
        if not addrs:
            raise ValueError("ServerPool needs at least one server address")
        self.addrs = list(addrs)
        self._dead: dict[str, str] = {}  # addr -> why
        self._sticky: OrderedDict[str, str] = OrderedDict()  # rid -> addr, oldest first
        self._max_sticky = max_sticky
        self._next = 0
        self._lock = threading.Lock()

    def live(self) -> list[str]:
        with self._lock:
            return [a for a in self.addrs if a not in self._dead]

    def dead(self) -> dict[str, str]:
        with self._lock:
            return dict(self._dead)

    def is_dead(self, addr: str) -> bool:
        with self._lock:
            return addr in self._dead

    def mark_dead(self, addr: str, why: str) -> None:
        with self._lock:
            if addr not in self._dead:
                self._dead[addr] = why
                logger.warning("inference server %s marked dead: %s", addr, why)

    def choose(self, rid: str | None) -> str:
        """The live server ``rid`` used last, else the next live one round-robin."""
        with self._lock:
            if rid is not None:
                addr = self._sticky.get(rid)
                if addr is not None and addr not in self._dead:
                    self._sticky.move_to_end(rid)
                    return addr
            n = len(self.addrs)
            for i in range(n):
                addr = self.addrs[(self._next + i) % n]
                if addr not in self._dead:
                    self._next = (self._next + i + 1) % n
                    break
            else:
                raise ServerUnavailableError(self.all_dead_message())
            if rid is not None:
                self._sticky[rid] = addr
                self._sticky.move_to_end(rid)
                while len(self._sticky) > self._max_sticky:
                    self._sticky.popitem(last=False)
            return addr

    def all_dead_message(self) -> str:
        why = "; ".join(f"{a} ({self._dead[a]})" for a in self.addrs)
        return f"all {len(self.addrs)} inference servers are marked dead: {why}"


# ------------------------------------------------------------------------------ engine


__all__ = ["SERVER_ADDRS_ENV", "ServerPool", "ServerUnavailableError", "parse_server_addrs"]
