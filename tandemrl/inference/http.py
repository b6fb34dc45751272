"""The one HTTP client every inference backend's requests go through.

Backends only build ``HttpRequest`` objects and parse the decoded JSON; this module sends
them. All traffic runs on a single event loop in a daemon thread that owns one aiohttp
session (one connection pool, no per-caller-loop sessions to leak): ``send`` awaits it
from any event loop (the rollout executor's, a test's, a user's), ``send_sync`` blocks
on it from plain threads, and ``HttpClient.submit`` runs a whole coroutine there (weight
updates fan out to all servers that way while the trainer keeps broadcasting).

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried ``retries`` times
with exponential backoff; 4xx and malformed URLs fail at once. The final error is an
``InferenceServerError`` whose one-line message names the method, server and path.
Every request carries the run's bearer token when one is set (``server_auth``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tandemrl.api.inference import HttpRequest
from tandemrl.inference.server_auth import auth_headers

if TYPE_CHECKING:
    import aiohttp

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0  # seconds, for requests that carry no timeout of their own
DEFAULT_BACKOFF = 0.5  # seconds before the first retry; doubles on each further one
MAX_BACKOFF = 10.0
CONNECT_TIMEOUT = 30.0  # opening a TCP connection; a refused one fails immediately anyway
# An idle pooled connection is dropped after this long: well under the 5 s after which uvicorn
# (vLLM's and SGLang's HTTP server) closes an idle keep-alive connection, so the pool never hands
# out one the server is closing.
KEEPALIVE_S = 2.0
_DETAIL_CHARS = 300


def retry_delay(backoff: float, attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): ``backoff`` doubling, at most ``MAX_BACKOFF``."""
    return min(backoff * 2 ** (attempt - 1), MAX_BACKOFF)


class InferenceServerError(RuntimeError):
    """A request to one inference server failed for good.

    ``status`` is the HTTP status (None when no response arrived); ``retryable`` tells
    whether the failure looked transient (connection, timeout, 429/5xx), i.e. whether
    another server might succeed where this one did not.
    """

    def __init__(
        self,
        addr: str,
        method: str,
        path: str,
        detail: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        attempts: int = 1,
    ) -> None:
        self.addr = addr
        self.method = method
        self.path = path
        self.detail = detail
        self.status = status
        self.retryable = retryable
        self.attempts = attempts
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{method} {base_url(addr)}{path} failed{tries}: {detail}")


def base_url(addr: str) -> str:
    """``http://host:port`` for ``host:port`` (IPv6 hosts get brackets)."""
    if addr.startswith(("http://", "https://")):
        return addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    if sep and ":" in host and not host.startswith("["):
        return f"http://[{host}]:{port}"
    return f"http://{addr}"


def _one_line(text: str) -> str:
    """First non-empty line of ``text``, shortened; error messages stay on one line."""
    for line in text.strip().splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= _DETAIL_CHARS else line[: _DETAIL_CHARS - 3] + "..."
    return "(empty body)"


def _error_detail(status: int, reason: str, body: str) -> str:
    """``HTTP 500 Internal Server Error: <message>``, using the JSON error message if there is one."""
    message = body
    try:
        decoded = json.loads(body)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        err = decoded.get("error", decoded.get("detail", decoded.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            message = str(err)
    return f"HTTP {status} {reason}: {_one_line(message)}".replace(" : ", ": ")


def _decode(body: str) -> Any:
    """JSON reply as Python; an empty body is ``{}`` and a non-JSON one ``{"text": body}``."""
    if not body.strip():
        return {}
    try:
        return json.loads(body)
    except ValueError:
        return {"text": body}


class _Attempt(Exception):
    """One failed attempt (internal): what went wrong and whether to try again."""

    def __init__(self, detail: str, status: int | None, retryable: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.retryable = retryable


class HttpClient:
    """An event-loop thread with one aiohttp session; see the module docstring."""

    def __init__(self, name: str = "tandemrl-http", send_token: bool = True) -> None:
        """``send_token``: attach the run's server token; False for services outside the run (a reward URL)."""
        self.name = name
        self.send_token = send_token
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # one new connection per request
        self._closed = False

    # ------------------------------------------------------------------ loop thread
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"HttpClient {self.name!r} is closed")
            if self._loop is None:
                ready = threading.Event()
                loop = asyncio.new_event_loop()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    ready.set()
                    loop.run_forever()

                thread = threading.Thread(target=main, name=self.name, daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def _get_session(self, fresh: bool = False) -> aiohttp.ClientSession:
        """The pooled session, or with ``fresh`` one that opens a new connection per request;
        created on first use inside the loop thread (aiohttp binds a session to its loop)."""
        import aiohttp

        if fresh:
            if self._fresh is None or self._fresh.closed:
                self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
            return self._fresh
        if self._session is None or self._session.closed:
            # limit=0: rollouts may keep hundreds of generate calls open at once.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the client's loop; the future can be waited on from any thread."""
        try:
            loop = self._ensure_loop()
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Block the calling (non-loop) thread until ``coro`` finished on the client's loop."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"HttpClient {self.name!r}: a blocking call was made from its own event loop thread")
        return self.submit(coro).result()

    # ------------------------------------------------------------------ sending
    async def send(
        self,
        addr: str,
        req: HttpRequest,
        timeout: float | None = None,
        retries: int = 0,
        backoff: float = DEFAULT_BACKOFF,
    ) -> Any:
        """Send ``req`` to ``addr`` ("host:port") and return the decoded JSON reply.

        ``req.timeout`` wins over ``timeout`` (then ``DEFAULT_TIMEOUT``); each attempt gets
        the full timeout. Transient failures are retried ``retries`` times, waiting
        ``backoff * 2**i`` seconds (at most ``MAX_BACKOFF``) before retry ``i``. A request
        sent with ``retries=0`` (one that must not be repeated, e.g. a weight receive) goes out
        on a new connection: a pooled one can be closed by the server just as the request
        leaves, which fails it without the server ever seeing it.
        """
        if retries < 0:
            raise ValueError(f"send: retries must be >= 0, got {retries}")
        if backoff < 0:
            raise ValueError(f"send: backoff must be >= 0, got {backoff}")
        loop = self._ensure_loop()
        coro = self._send(addr, req, timeout, retries, backoff)
        if asyncio.get_running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def send_sync(
        self,
        addr: str,
        req: HttpRequest,
        timeout: float | None = None,
        retries: int = 0,
        backoff: float = DEFAULT_BACKOFF,
    ) -> Any:
        """``send`` for code without an event loop (control calls from the trainer thread)."""
        return self.run_sync(self._send(addr, req, timeout, retries, backoff))

    async def _send(self, addr: str, req: HttpRequest, timeout: float | None, retries: int, backoff: float) -> Any:
        total = req.timeout if req.timeout is not None else (timeout if timeout is not None else DEFAULT_TIMEOUT)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._attempt(addr, req, total, fresh=retries == 0)
            except _Attempt as e:
                if not e.retryable or attempt > retries:
                    raise InferenceServerError(
                        addr, req.method, req.path, e.detail, status=e.status, retryable=e.retryable, attempts=attempt
                    ) from None
            await asyncio.sleep(retry_delay(backoff, attempt))

    async def _attempt(self, addr: str, req: HttpRequest, total: float, fresh: bool) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=total, sock_connect=min(total, CONNECT_TIMEOUT))
        try:
            async with self._get_session(fresh).request(
                req.method,
                base_url(addr) + req.path,
                json=req.json,
                timeout=timeout,
                headers=auth_headers() if self.send_token else {},
            ) as resp:
                body = await resp.text(errors="replace")
                if resp.status >= 400:
                    retryable = resp.status >= 500 or resp.status == 429
                    raise _Attempt(_error_detail(resp.status, resp.reason or "", body), resp.status, retryable)
                return _decode(body)
        except aiohttp.InvalidURL as e:
            raise _Attempt(f"invalid server address ({e})", None, False) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise _Attempt(f"no reply within {total:g}s", None, True) from None
        except (aiohttp.ClientError, OSError) as e:
            text = str(e).strip()
            raise _Attempt(f"{type(e).__name__}: {_one_line(text)}" if text else type(e).__name__, None, True) from None

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 10.0) -> None:
        """Close the session and stop the loop thread; later calls raise RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def shutdown() -> None:
            for session in (self._session, self._fresh):
                if session is not None and not session.closed:
                    await session.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()


_shared: HttpClient | None = None
_shared_pid = -1
_shared_lock = threading.Lock()


def shared_client() -> HttpClient:
    """The process-wide client (a forked child gets a fresh one: threads do not survive fork)."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared, _shared_pid = HttpClient(), os.getpid()
        return _shared


async def send(
    addr: str, req: HttpRequest, timeout: float | None = None, retries: int = 0, backoff: float = DEFAULT_BACKOFF
) -> Any:
    """``HttpClient.send`` on the shared client."""
    return await shared_client().send(addr, req, timeout, retries, backoff)


def send_sync(
    addr: str, req: HttpRequest, timeout: float | None = None, retries: int = 0, backoff: float = DEFAULT_BACKOFF
) -> Any:
    """``HttpClient.send_sync`` on the shared client."""
    return shared_client().send_sync(addr, req, timeout, retries, backoff)


@atexit.register
def _close_shared() -> None:
    if _shared is not None and _shared_pid == os.getpid():
        _shared.close(timeout=2.0)
