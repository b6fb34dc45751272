"""Per-run bearer token between the trainer and the inference servers it drives.

The launchers put a fresh random token in ``TANDEMRL_SERVER_TOKEN`` for each run: the
servers they start refuse any request without ``Authorization: Bearer <token>`` (401),
and ``tandemrl.inference.http`` sends that header whenever the variable is set. The token
travels only through the environment (never a command line or a log).

vLLM's own ``--api-key`` guards only the ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
prefixes, not the control and weight-update routes the trainer uses (``/collective_rpc``,
``/pause``, ``/resume``, ``/update_weight_version``...), so vLLM servers load
``TokenMiddleware`` (``--middleware``) instead, which guards every route but ``/health``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TOKEN_ENV = "TANDEMRL_SERVER_TOKEN"
UNGUARDED_PATHS = frozenset({"/health"})  # the launcher's readiness probe

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_token() -> str:
    """A fresh random token for one run."""
    return secrets.token_urlsafe(32)


def auth_headers() -> dict[str, str]:
    """The header a client sends: empty when no token is set."""
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class TokenMiddleware:
    """ASGI middleware: every HTTP/websocket request but ``/health`` needs the run's token."""

    def __init__(self, app: ASGIApp) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"TokenMiddleware: ${TOKEN_ENV} is not set in the server's environment")
        self.app = app
        self._expected = _digest(token)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(given), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "missing or wrong bearer token"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
