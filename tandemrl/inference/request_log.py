"""Server-side request log: one JSON line per HTTP request, with the server's wall-clock times.

The launchers load ``RequestLogMiddleware`` into each vLLM server they start and point
``TANDEMRL_REQUEST_LOG`` at ``<run_dir>/<backend>-server-<i>-requests.jsonl``. Each line is
``{"path": ..., "status": ..., "start": ..., "end": ...}`` (``time.time()`` seconds, written when the
response finishes): what the server was doing and when, e.g. to check that a colocated server
generated nothing during the trainer's turns (``tandemrl.trainers.turns``). ``/health`` is left out.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

REQUEST_LOG_ENV = "TANDEMRL_REQUEST_LOG"
_SKIPPED = frozenset({"/health"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class RequestLogMiddleware:
    """ASGI middleware appending each finished HTTP request to ``$TANDEMRL_REQUEST_LOG``."""

    def __init__(self, app: ASGIApp) -> None:
        path = os.environ.get(REQUEST_LOG_ENV, "")
        if not path:
            raise RuntimeError(f"RequestLogMiddleware: ${REQUEST_LOG_ENV} is not set in the server's environment")
        self.app = app
        self.path = path

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _SKIPPED:
            await self.app(scope, receive, send)
            return
        start = time.time()
        status: list[int] = []

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            line = {
                "path": scope.get("path"),
                "status": status[0] if status else None,
                "start": start,
                "end": time.time(),
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")


def read_request_log(path: str) -> list[dict[str, Any]]:
    """The entries of one server's request log, in the order they finished."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
