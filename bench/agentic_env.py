"""The world of ``bench/async_agentic.py``: a calculator tool behind a real HTTP service whose replies take a
drawn latency, the agent that calls it through the policy, and a GSM8K workflow with heavy-tailed lengths.

* :class:`Latency`: a stated, seeded distribution (lognormal by median and p99, Pareto, or fixed).
* :class:`ToolService`: ``POST /calculate {"expression": ...}`` answers after a latency drawn per request,
  served by aiohttp on its own thread, so any number of calls wait at once.
* :func:`tool_agent`: an ``AgentWorkflow`` agent (docs/agents.md). The tiny model never calls tools by itself,
  so its first reply is forced to a calculator call with vLLM's ``structured_outputs``, as the agent tests do;
  the call goes to the service at ``$TANDEMRL_BENCH_TOOL_URL`` through one aiohttp session per event loop,
  at most ``$TANDEMRL_BENCH_TOOL_CONCURRENCY`` (64) at once; then the model answers and is scored on GSM8K.
* :class:`LongTailWorkflow`: RLVR on GSM8K where each request's ``max_new_tokens`` is drawn from a Pareto
  distribution (the tiny model rarely stops early, so its lengths follow the draw).

The trainer process imports this module (``agent.agent=agentic_env:tool_agent``, ``bench/`` on
``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gsm8k_agent import CALCULATOR, calculate  # noqa: E402  (the example's tool, served over HTTP here)

from tandemrl.api.inference import ModelRequest  # noqa: E402
from tandemrl.configs.rollout import GenerationHyperparameters  # noqa: E402
from tandemrl.rewards.gsm8k import gsm8k_reward_fn  # noqa: E402
from tandemrl.workflows.rlvr import RLVRWorkflow  # noqa: E402

TOOL_URL_ENV = "TANDEMRL_BENCH_TOOL_URL"
TOOL_CONCURRENCY_ENV = "TANDEMRL_BENCH_TOOL_CONCURRENCY"
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class Latency:
    """Seconds per call: ``lognormal`` (``median``, ``p99``), ``pareto`` (minimum ``median``, tail ``alpha``)
    or ``fixed`` (``median``); draws are reproducible from ``seed``."""

    kind: str = "lognormal"
    median: float = 0.5
    p99: float = 5.0
    alpha: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "pareto", "fixed"):
            raise ValueError(f"Latency.kind must be lognormal, pareto or fixed, got {self.kind!r}")
        if not self.median >= 0 or (self.kind == "lognormal" and not self.p99 > self.median > 0):
            raise ValueError(f"Latency: need 0 < median < p99, got median {self.median}, p99 {self.p99}")
        if self.kind == "pareto" and not (self.alpha > 0 and self.median > 0):
            raise ValueError(f"Latency: pareto needs median > 0 and alpha > 0, got {self.median}, {self.alpha}")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.median
        if self.kind == "pareto":
            return self.median * rng.paretovariate(self.alpha)
        sigma = math.log(self.p99 / self.median) / _Z99
        return rng.lognormvariate(math.log(self.median), sigma)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.median} s"
        if self.kind == "pareto":
            return f"pareto (minimum {self.median} s, alpha {self.alpha}), seed {self.seed}"
        sigma = math.log(self.p99 / self.median) / _Z99
        mean = self.median * math.exp(sigma**2 / 2)
        return f"lognormal (median {self.median} s, p99 {self.p99} s, mean {mean:.2f} s), seed {self.seed}"


class ToolService:
    """The calculator over HTTP on 127.0.0.1, each reply after a drawn latency (or ``latency_of(body)``).

    ``with ToolService(Latency()) as tools: ... tools.url ...``; ``served`` counts the replies sent.
    """

    def __init__(self, latency: Latency, latency_of: Callable[[dict[str, Any]], float] | None = None) -> None:
        self.latency = latency
        self.latency_of = latency_of
        self.served = 0
        self.url = ""
        self._rng = random.Random(latency.seed)
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._waiting: set[asyncio.Task[Any]] = set()  # replies not yet sent
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-tool-service", daemon=True)

    async def _calculate(self, request: web.Request) -> web.Response:
        body = await request.json()
        delay = self.latency_of(body) if self.latency_of is not None else self.latency.draw(self._rng)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            await asyncio.sleep(delay)
        finally:
            self._waiting.discard(task)
        self.served += 1
        return web.json_response({"result": calculate(str(body.get("expression", ""))), "latency": delay})

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/calculate", self._calculate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> ToolService:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    async def _stop(self) -> None:
        for task in list(self._waiting):  # a reply still waiting out its latency is not sent
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)


_CAPS: dict[int, asyncio.Semaphore] = {}


def _cap() -> asyncio.Semaphore:
    """This event loop's cap on tool calls at once (a semaphore belongs to one loop)."""
    loop = asyncio.get_running_loop()
    cap = _CAPS.get(id(loop))
    if cap is None:
        cap = _CAPS[id(loop)] = asyncio.Semaphore(int(os.environ.get(TOOL_CONCURRENCY_ENV, "64")))
    return cap


async def call_tool(expression: str, url: str | None = None) -> str:
    """The service's answer for ``expression`` (never blocks the event loop; waits for a free slot). One
    session per call: a call waits out a tool latency of about a second, next to which opening a local
    connection is nothing, and no session outlives its call (none is left unclosed when the run ends)."""
    async with _cap(), ClientSession(timeout=ClientTimeout(total=600)) as session:
        async with session.post(f"{url or os.environ[TOOL_URL_ENV]}/calculate", json={"expression": expression}) as r:
            r.raise_for_status()
            return str((await r.json())["result"])


def forced_call_regex() -> str:
    """A Qwen2 calculator call on a two-operand expression, for ``structured_outputs``."""
    args = '\\{"expression": "[1-9][0-9]?[+*-][1-9][0-9]?"\\}'
    return '<tool_call>\\n\\{"name": "calculator", "arguments": ' + args + "\\}\\n</tool_call>"


async def tool_agent(client: Any, sample: dict[str, Any]) -> float:
    """One forced calculator call, the tool's reply from the HTTP service, then the model's answer."""
    messages: list[dict[str, Any]] = [*sample["messages"]]
    first = await client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[CALCULATOR],
        extra_body={"structured_outputs": {"regex": forced_call_regex()}},
    )
    msg = first.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        expression = str(json.loads(call.function.arguments).get("expression", ""))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": await call_tool(expression)})
    final = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    answer = final.choices[0].message.content or ""
    return await asyncio.to_thread(gsm8k_reward_fn, None, answer, None, None, answer=sample["answer"])


class LongTailWorkflow(RLVRWorkflow):
    """RLVR whose every request draws ``max_new_tokens`` from Pareto(minimum ``min_tokens``, ``alpha``), capped at
    ``gconfig.max_new_tokens``. The n-th request for a prompt draws from a generator seeded by the prompt and n,
    so every variant of the benchmark draws the same lengths for the same rows."""

    def __init__(self, *args: Any, min_tokens: int = 16, alpha: float = 1.2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_tokens, self.alpha = min_tokens, alpha
        self._drawn: dict[bytes, int] = {}

    def draw_tokens(self, prompt_ids: Any, cap: int) -> int:
        key = hashlib.sha256(str(list(prompt_ids)).encode()).digest()[:8]
        n = self._drawn.get(key, 0)
        self._drawn[key] = n + 1
        rng = random.Random(int.from_bytes(key, "big") * 1_000_003 + n)
        return min(cap, math.ceil(self.min_tokens * rng.paretovariate(self.alpha)))

    def request(
        self, prompt_ids: Any, gconfig: GenerationHyperparameters, rid: str, seed: int | None = None
    ) -> ModelRequest:
        tokens = self.draw_tokens(prompt_ids, gconfig.max_new_tokens)
        return super().request(prompt_ids, gconfig.new(max_new_tokens=tokens), rid, seed)
