"""The ``tinker`` SDK versions tinker-serve serves (docs/tinker.md, "Supported SDK versions").

The SDK names its version in every request: ``X-Stainless-Package-Version: 0.38.0`` and a User-Agent such as
``AsyncTinker/Python 0.38.0``. A request from an SDK older than :data:`OLDEST` is answered with HTTP 400 and one
line naming the range (the SDK raises ``tinker.BadRequestError``), since such an SDK speaks a wire format this
server does not (JSON forward_backward bodies and results). A newer SDK than :data:`NEWEST` is served, with one
warning line in the server log per version. A request that names no SDK version (curl, a raw HTTP client) is
served as it is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

logger = logging.getLogger("tandemrl.tinker")

OLDEST = "0.20.0"  # the oldest SDK tests/integration/test_tinker_compat.py runs; 0.19.0 is refused
NEWEST = "0.38.0"  # the lock's SDK (requirements/cpu.lock), the newest tested
VERSION_HEADER = "X-Stainless-Package-Version"
_USER_AGENT = re.compile(r"^(?:Async)?Tinker/Python\s+(\S+)")
_NUMBERS = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string (``0.38.0``, ``0.40.0rc1``, ``1.2``); None if it has none."""
    match = _NUMBERS.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def sdk_version(headers: Mapping[str, str]) -> str | None:
    """The SDK version a request names: its ``X-Stainless-Package-Version``, else its User-Agent's; else None."""
    version = headers.get(VERSION_HEADER, "").strip()
    if version:
        return version
    match = _USER_AGENT.match(headers.get("User-Agent", ""))
    return match.group(1) if match else None


class SdkRange:
    """Refuses requests of SDKs older than ``oldest``; warns once per version newer than ``newest``."""

    def __init__(self, oldest: str = OLDEST, newest: str = NEWEST) -> None:
        self.oldest, self.newest = oldest, newest
        self._oldest, self._newest = release(oldest), release(newest)
        self.warned: set[str] = set()

    def refusal(self, version: str | None) -> str | None:
        """The one-line refusal for ``version``, or None if it is served (a newer one is logged once)."""
        number = release(version) if version is not None else None
        if version is None or number is None:
            return None
        if self._oldest is not None and number < self._oldest:
            return (
                f"tinker SDK {version} is outside the versions tinker-serve supports ({self.oldest} to "
                f"{self.newest}); pip install 'tinker>={self.oldest},<={self.newest}'"
            )
        if self._newest is not None and number > self._newest and version not in self.warned:
            self.warned.add(version)
            logger.warning(
                "tinker-serve: tinker SDK %s is newer than the versions tinker-serve is tested with (%s to %s); "
                "serving it anyway",
                version,
                self.oldest,
                self.newest,
            )
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        message = self.refusal(sdk_version(request.headers))
        if message is not None:
            return web.Response(status=400, text=message)
        return await handler(request)
