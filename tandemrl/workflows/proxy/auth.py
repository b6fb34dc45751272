"""Who may talk to a proxy: a bearer key per agent session, and loopback peers only when bound to loopback."""

from __future__ import annotations

import hmac
import ipaddress
import secrets


def new_api_key() -> str:
    """A fresh random key (one per agent session; it also names the session)."""
    return "tandemrl-" + secrets.token_urlsafe(24)


def bearer_key(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, None if absent or malformed."""
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def same_key(given: str, expected: str) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(given.encode(), expected.encode())


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an IP address or "localhost") is a loopback address."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool((mapped or addr).is_loopback)
