"""The agent proxy: an OpenAI-compatible HTTP endpoint in front of a ``GenerationClient``.

Started in-process on the rollout's event loop (aiohttp). Each agent session gets its own
random API key, which also names the session: every call made with it is recorded in that
session's :class:`~tandemrl.workflows.proxy.trajectory.Session`. Routes: ``POST
/v1/chat/completions``, ``POST /v1/completions`` (streaming or not), ``GET /v1/models``.
Requests without a session's key get 401; bound to a loopback address, requests from other
peers get 403 (unless ``allow_remote``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.api.workflow import GenerationClient
from tandemrl.workflows.proxy import openai_format as fmt
from tandemrl.workflows.proxy.auth import bearer_key, is_loopback, new_api_key, same_key
from tandemrl.workflows.proxy.render import BadRequest, ChatRenderer, normalize_messages
from tandemrl.workflows.proxy.sampling import request_gconfig, request_metadata
from tandemrl.workflows.proxy.tool_parsers import ParsedReply, get_tool_parser
from tandemrl.workflows.proxy.trajectory import Mode, Session
from tandemrl.workflows.rlvr import check_response

logger = logging.getLogger(__name__)


@dataclass
class AgentSession:
    """One agent's key, its recorded calls, and errors the proxy hit while serving it."""

    key: str
    session: Session
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    errors: list[BaseException] = field(default_factory=list)
    model_seconds: float = 0.0  # wall time of its model calls (the rest of its run is the agent's own)


_SESSION = web.RequestKey("tandemrl_session", AgentSession)


class AgentProxy:
    """See the module docstring. ``async with AgentProxy(...) as proxy`` starts and stops it."""

    def __init__(
        self,
        client: GenerationClient,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        mode: Mode = "prefix",
        tool_parser: str = "qwen2",
        chat_template: str | None = None,
        enable_thinking: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool | None = None,
        max_context_len: int | None = None,
        model_name: str = "tandemrl-policy",
    ) -> None:
        Session(mode)  # validates the mode
        self.client = client
        self.gconfig = gconfig
        self.mode: Mode = mode
        self.parse_tools = get_tool_parser(tool_parser)
        self.renderer = ChatRenderer(tokenizer, chat_template, enable_thinking)
        self.host, self.port = host, port
        self.allow_remote = (not is_loopback(host)) if allow_remote is None else allow_remote
        self.max_context_len = max_context_len
        self.model_name = model_name
        self.sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AgentProxy:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> AgentProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        """What to pass as the openai client's ``base_url``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def open_session(self) -> AgentSession:
        s = AgentSession(new_api_key(), Session(self.mode))
        self.sessions[s.key] = s
        return s

    def close_session(self, s: AgentSession) -> Session:
        self.sessions.pop(s.key, None)
        return s.session

    # ------------------------------------------------------------------ guard
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if not self.allow_remote and not is_loopback(request.remote):
            return web.json_response(
                fmt.error_body("only loopback clients may use this proxy", "forbidden"), status=403
            )
        key = bearer_key(request.headers.get("Authorization"))
        found = next((s for k, s in self.sessions.items() if key is not None and same_key(key, k)), None)
        if found is None:
            return web.json_response(fmt.error_body("missing or invalid API key", "authentication_error"), status=401)
        request[_SESSION] = found
        try:
            return await handler(request)
        except BadRequest as e:
            return web.json_response(fmt.error_body(str(e)), status=400)
        except Exception as e:  # kept for the workflow to re-raise: never lost in the server
            found.errors.append(e)
            logger.exception("agent proxy: %s failed", request.path)
            return web.json_response(fmt.error_body(f"{type(e).__name__}: {e}", "server_error"), status=500)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    # ------------------------------------------------------------------ routes
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _generate(self, s: AgentSession, prompt: list[int], body: dict[str, Any]) -> tuple[ModelResponse, bool]:
        """The model's response, and whether the request constrained its output (structured outputs)."""
        gconfig = request_gconfig(self.gconfig, body, len(prompt), self.max_context_len)
        meta = request_metadata(body)
        req = ModelRequest(rid=s.rid, input_ids=prompt, gconfig=gconfig, metadata=meta, tokenizer=None)
        start = time.perf_counter()
        try:
            resp = await self.client.agenerate(req)
        finally:
            s.model_seconds += time.perf_counter() - start
        check_response(resp)
        return resp, "structured_outputs" in meta

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        s: AgentSession = request[_SESSION]
        body = await self._body(request)
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools") or None
        render = self.renderer
        plan = s.session.plan(
            render.prompt_ids(messages, tools), messages, lambda out, new: render.suffix_ids(out, new, tools)
        )
        resp, constrained = await self._generate(s, plan.prompt_ids, body)
        text = render.decode(resp.output_tokens)
        use_tools = tools is not None and body.get("tool_choice", "auto") != "none"
        parsed = self.parse_tools(text) if use_tools else ParsedReply(text or None)
        s.session.stats["tool_parse_failed"] += parsed.failed
        reply = normalize_messages([fmt.assistant_message(parsed)])[0]
        s.session.commit(plan, resp, reply, messages, constrained)
        args = (self.model_name, parsed, fmt.finish_reason(resp.stop_reason, parsed), len(plan.prompt_ids))
        return await _reply(request, body, fmt.chat_body, fmt.chat_chunks, *args, len(resp.output_tokens))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        s: AgentSession = request[_SESSION]
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.renderer.ids(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids")
        plan = s.session.plan(ids)
        resp, constrained = await self._generate(s, plan.prompt_ids, body)
        s.session.commit(plan, resp, None, constrained=constrained)
        text = self.renderer.decode(resp.output_tokens)
        args = (self.model_name, text, fmt.finish_reason(resp.stop_reason, None), len(plan.prompt_ids))
        return await _reply(request, body, fmt.completion_body, fmt.completion_chunks, *args, len(resp.output_tokens))


async def _reply(
    request: web.Request,
    body: dict[str, Any],
    whole: Callable[..., dict[str, Any]],
    chunks: Callable[..., list[bytes]],
    *args: Any,
) -> web.StreamResponse:
    """The reply as one JSON body, or (``stream``) as server-sent events."""
    if not body.get("stream"):
        return web.json_response(whole(*args))
    opts = body.get("stream_options")
    events = chunks(*args, bool(isinstance(opts, dict) and opts.get("include_usage")))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for event in events:
        await resp.write(event)
    await resp.write_eof()
    return resp
