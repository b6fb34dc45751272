"""The shared HTTP client never sends a request that must not be repeated on a reused connection.

A keep-alive server (uvicorn: vLLM, SGLang) closes a connection that sat idle for 5 s. If the
client's pool hands out that connection just as the server closes it, the request fails with
``ServerDisconnectedError`` although the server never saw it. A generate call retries; a weight
receive (sent with ``retries=0``) cannot, and a GRPO run failed that way (its collective update
after a 5 s pause between steps). ``OneShotServer`` makes that race certain: it answers the first
request of each connection and drops the connection at the second, unanswered.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from utils import free_port

from tandemrl.api.inference import HttpRequest
from tandemrl.inference import http as http_module
from tandemrl.inference.http import KEEPALIVE_S, HttpClient

RECEIVE = HttpRequest("POST", "/collective_rpc", {"method": "receive"})


class OneShotServer:
    """HTTP/1.1 on loopback: one answered request per connection (kept open), a second one is dropped."""

    def __init__(self) -> None:
        self.port = free_port()
        self.answered: list[int] = []  # connection number of each answered request
        self.dropped: list[int] = []  # connection number of each request dropped unanswered
        self._connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        conn, served = self._connections, 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            if served:  # the keep-alive race: the server closes as the reused connection's request arrives
                self.dropped.append(conn)
                writer.close()
                return
            served += 1
            self.answered.append(conn)
            body = json.dumps({"ok": True}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()

    def __enter__(self) -> OneShotServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:  # connections still waiting for a next request
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def client() -> Iterator[HttpClient]:
    c = HttpClient("test-keepalive")
    yield c
    c.close()


def test_unrepeatable_requests_each_get_a_new_connection(client: HttpClient) -> None:
    with OneShotServer() as server:
        for _ in range(3):
            assert client.send_sync(server.addr, RECEIVE, retries=0) == {"ok": True}
    assert server.answered == [1, 2, 3] and server.dropped == []


def test_the_pool_reuses_connections_and_a_retry_covers_the_race(
    client: HttpClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: pooled requests (``retries`` > 0, e.g. generate) do meet the dropped request,
    so the server above really models the race, and the retry on a new connection recovers. POST:
    aiohttp itself re-sends an idempotent method (GET) once when a reused connection drops it."""
    # The pool keeps an idle connection KEEPALIVE_S (2 s): a loaded machine pausing that long between two
    # requests would get a new connection instead. Kept for the test's length (the session is made at first use).
    monkeypatch.setattr(http_module, "KEEPALIVE_S", 600.0)
    ping = HttpRequest("POST", "/inference/v1/generate", {"input_ids": [1]})
    with OneShotServer() as server:
        assert client.send_sync(server.addr, ping, retries=1, backoff=0.0) == {"ok": True}
        assert client.send_sync(server.addr, ping, retries=1, backoff=0.0) == {"ok": True}
        assert server.answered == [1, 2] and server.dropped == [1]
        # One pooled attempt (what a weight receive was before): connection 2 is reused and dropped.
        with pytest.raises(Exception, match="ServerDisconnectedError"):
            client.run_sync(client._attempt(server.addr, ping, 10.0, fresh=False))
        assert server.dropped == [1, 2]


def test_idle_pooled_connections_are_dropped_before_the_servers_timeout() -> None:
    assert 0 < KEEPALIVE_S < 5.0  # uvicorn's default keep-alive timeout, which vLLM and SGLang keep
