"""The HTTP face of ``tandemrl tinker-serve``: the routes of the Tinker REST API the ``tinker`` SDK calls.

Every ``/api/v1`` route needs the run's API key in ``X-API-Key`` (401 otherwise). Bad input is
answered at submission with HTTP 400 (404 for an unknown id, 410 for a finished session) and a one-line body,
which the SDK raises as ``tinker.BadRequestError`` / ``tinker.NotFoundError``; a call that fails
while it runs comes back from ``retrieve_future`` as a failed request (``tinker.RequestFailedError``).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tandemrl.tinker.sdk_range import SdkRange
from tandemrl.tinker.service import Gone, NotFound, Result, TinkerService
from tandemrl.tinker.wire import UserError

logger = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new_api_key() -> str:
    """A fresh per-run key; the SDK accepts only keys that start with ``tml-``."""
    return "tml-tandemrl-" + secrets.token_urlsafe(24)


def _one_line(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message.strip().splitlines()[0] if message.strip() else "error")


class TinkerServer:
    """``await TinkerServer(service, key).start(host, port)``; ``stop()`` ends it."""

    def __init__(self, service: TinkerService, api_key: str) -> None:
        self.service = service
        self.api_key = api_key
        self.runner: web.AppRunner | None = None
        self.sdk_range = SdkRange()  # an SDK older than the tested range gets one line (400), before the key check

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.sdk_range.middleware, self._guard], client_max_size=512 * 1024 * 1024)
        s = self.service
        get, post = app.router.add_get, app.router.add_post
        get("/api/v1/healthz", self._json(lambda _b: {"status": "ok"}))
        get("/api/v1/get_server_capabilities", self._json(lambda _b: s.capabilities()))
        post("/api/v1/client/config", self._json(lambda _b: client_config()))
        post("/api/v1/client/dynamic_config", self._json(lambda _b: {"refresh_interval_sec": 3600}))
        post("/api/v1/create_session", self._json(lambda _b: s.create_session()))
        post("/api/v1/session_heartbeat", self._json(s.session_heartbeat))
        post("/api/v1/telemetry", self._json(lambda _b: {"status": "accepted"}))
        post("/api/v1/create_model", self._json(s.create_model))
        post("/api/v1/get_info", self._json(lambda b: s.get_info(str(b.get("model_id")))))
        post("/api/v1/unload_model", self._json(lambda b: s.unload_model(str(b.get("model_id")))))
        post("/api/v1/forward_backward", self._forward_backward)
        post("/api/v1/optim_step", self._json(s.optim_step))
        post("/api/v1/save_weights", self._json(s.save_weights))
        post("/api/v1/load_weights", self._json(s.load_weights))
        post("/api/v1/save_weights_for_sampler", self._json(s.save_weights_for_sampler))
        post("/api/v1/create_sampling_session", self._async_json(s.create_sampling_session))
        post("/api/v1/asample", self._json(s.sample))
        post("/api/v1/retrieve_future", self._retrieve)
        get("/api/v1/samplers/{sid}", self._sampler)
        post("/api/v1/sessions/{sid}/finish", self._finish)
        get("/api/v1/training_runs", self._query(lambda q: s.listing.list_runs(q.get("limit"), q.get("offset"))))
        get("/api/v1/training_runs/{rid}", self._query(lambda q: s.listing.run(q["rid"])))
        get("/api/v1/training_runs/{rid}/checkpoints", self._query(lambda q: s.listing.list_checkpoints(q["rid"])))
        return app

    async def start(self, host: str, port: int) -> int:
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=5.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ------------------------------------------------------------------ middleware and adapters
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = request.headers.get("X-API-Key", "")
        if not hmac.compare_digest(key.encode(), self.api_key.encode()):
            return _one_line(401, "X-API-Key: missing or not this server's key (tinker-serve prints it at start)")
        try:
            return await handler(request)
        except NotFound as err:
            return _one_line(404, str(err))
        except Gone as err:
            return _one_line(410, str(err))
        except UserError as err:
            return _one_line(400, str(err))
        except web.HTTPException:
            raise
        except Exception as err:  # noqa: BLE001 - any other failure is the server's, in one line
            logger.exception("tinker-serve: %s failed", request.path)
            return _one_line(500, f"{type(err).__name__}: {err}")

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as err:
            raise UserError(f"{request.path}: body is not JSON ({err})") from None
        if not isinstance(body, dict):
            raise UserError(f"{request.path}: body must be a JSON object")
        return body

    def _json(self, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(fn(await self._body(request)))

        return handle

    def _async_json(self, fn: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(await fn(await self._body(request)))

        return handle

    def _query(self, fn: Callable[[dict[str, str]], dict[str, Any]]) -> Handler:
        """A GET route: ``fn`` of the query parameters and the path's match info."""

        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(fn({**request.query, **request.match_info}))

        return handle

    async def _forward_backward(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Content-Encoding", "") not in ("", "identity"):
            raise UserError("forward_backward: compressed bodies are not supported (proto_compress_fwdbwd is off)")
        return web.json_response(self.service.forward_backward(await request.read()))

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        out = await self.service.retrieve(str(body.get("request_id")))
        if isinstance(out, Result):
            if out.proto is not None:
                return web.Response(body=out.proto, content_type=PROTO)
            return web.json_response(out.json)
        return web.json_response(out)

    async def _finish(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.service.finish_session(request.match_info["sid"], await self._body(request)))

    async def _sampler(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.service.get_sampler(request.match_info["sid"]))


def client_config() -> dict[str, Any]:
    """The SDK's feature flags for this server: API-key auth, plain httpx, uncompressed proto, per-request polling;
    ``proto_write_fwdbwd`` makes the SDKs 0.19-0.24 send forward_backward as proto too (JSON otherwise)."""
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "proto_write_fwdbwd": True,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
        "parallel_fwdbwd_chunks": False,
    }
