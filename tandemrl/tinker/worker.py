"""The one training worker of ``tandemrl tinker-serve``: calls run on it in submission order.

A daemon thread, so that a stop does not wait for the call it is running (a ``forward_backward``
on a big batch cannot be interrupted). A queued call whose future was cancelled (the service's
``fail_pending`` at a stop) is skipped; ``close`` ends the thread after the calls already queued,
waits a bounded while, and reports whether the thread is still busy; the process can then exit
without it. Each call logs a start and a finish line (``tandemrl.tinker`` logger).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
_Item = tuple[int, str, Callable[[], Any], "asyncio.Future[Any] | None", asyncio.AbstractEventLoop | None]


class TrainWorker:
    """``await worker.submit(name, fn)`` runs ``fn`` on the worker thread after every earlier call."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="tinker-train", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``fn`` (call it ``name`` in the log); the future is cancelled if the worker closes first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.put((next(self._ids), name, fn, fut, loop))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, name, fn, fut, loop = item
            if fut is None or loop is None:  # the last call of close: no one waits for it
                _run_last(name, fn)
                continue
            if fut.done():  # cancelled while queued
                continue
            logger.info("tinker-serve: call %d (%s) started", call, name)
            try:
                result, err = fn(), None
            except Exception as e:  # noqa: BLE001 - the caller's future carries it
                result, err = None, e
            logger.info("tinker-serve: call %d (%s) %s", call, name, "failed" if err else "done")
            try:
                loop.call_soon_threadsafe(_settle, fut, result, err)
            except RuntimeError:  # the event loop is closed: the server stopped meanwhile
                return

    def close(self, wait_s: float, last: Callable[[], Any] | None = None) -> bool:
        """Stop taking calls (``last`` runs after the calls queued) and wait up to ``wait_s`` for the running one;
        True if the thread is still busy."""
        if last is not None:
            self._queue.put((0, "close", last, None, None))
        self._queue.put(None)
        self._thread.join(wait_s)
        return self._thread.is_alive()


def _run_last(name: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - nobody waits for it: log it
        logger.warning("tinker-serve: %s failed: %s", name, e)


def _settle(fut: asyncio.Future[Any], result: Any, err: BaseException | None) -> None:
    if fut.done():  # cancelled by a stop while it ran
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(result)
