"""A daemon thread running one asyncio event loop that other threads schedule work on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class AsyncTaskRunner:
    """A daemon thread running one asyncio event loop that other threads schedule work on."""

    def __init__(self, name: str = "tandemrl-rollout") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"AsyncTaskRunner {self.name!r} is not running; call start() first")
        return self._loop

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._loop is not None

    def start(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            raise RuntimeError(f"AsyncTaskRunner {self.name!r} was already started")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"AsyncTaskRunner {self.name!r}: event loop did not start within {timeout}s")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(_log_loop_exception)
        self._loop = loop
        self._started.set()
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._loop = None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (thread-safe, non-blocking)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run_coroutine(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Schedule a coroutine on the loop; the returned future is safe to wait on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything still running on the loop, then join the thread."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed between the check and the call
                pass
        thread.join(timeout)
        if thread.is_alive():
            logger.warning(
                "AsyncTaskRunner %r did not stop within %.0fs; leaving the daemon thread", self.name, timeout
            )
        self._thread = None


def _log_loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    detail = f"{type(exc).__name__}: {exc}" if exc is not None else context.get("message", "")
    logger.error("rollout event loop: %s", str(detail).splitlines()[0] if detail else "unknown error")
