"""The sampling side of ``tandemrl tinker-serve``: a LoRA-enabled vLLM server, one adapter name per saved sampler.

Requests are built by tandemrl's ``VLLMBackend`` (it never opens a socket) and sent by the
shared ``HttpClient``; a saved adapter is loaded under its own name (vLLM multi-LoRA), and a
sample names it as the request's ``model``. Every save of a name loads it again, under a vLLM
name of its own (``<name>@<sampler tag>.<load>``, the tag random per sampler so that two tinker-serve processes
can share one vLLM server): vLLM keys an adapter's cached prefix KV by its name and
path, so a reload under the old name would keep serving KV of the old weights, and an in-place
load (``load_inplace``) stays on the adapter's request and makes vLLM reload it from disk at every
step. A replaced load is unloaded from vLLM once no sample uses it. A failed vLLM call is
reported without the vLLM server's address (``VLLMError``; ``VLLMRejected`` when vLLM answered 4xx).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.inference import HttpRequest, ModelRequest, WeightUpdateMeta
from tandemrl.inference.backend import require, require_list
from tandemrl.inference.http import HttpClient, InferenceServerError, base_url
from tandemrl.inference.registry import get_backend
from tandemrl.tinker.wire import UserError

# The inference backend tinker-serve samples through (its run-time adapter routes, /v1/load_lora_adapter, are vLLM's).
SAMPLER_BACKEND = "vllm"

logger = logging.getLogger(__name__)
TopK = list[list[tuple[int, float]] | None]  # per prompt position: (token id, logprob) by rank, None for the first


class VLLMError(RuntimeError):
    """A vLLM call failed; the message names the route, never the server's address."""


class VLLMRejected(UserError):
    """vLLM refused the request (HTTP 4xx): the caller's input; no server address in the message."""


def _with(req: HttpRequest, adapter: str | None, **params: Any) -> HttpRequest:
    """``req`` naming ``adapter`` as its model, with ``params`` set in its ``sampling_params``."""
    body = dict(req.json or {})
    if adapter is not None:
        body["model"] = adapter
    if params:
        body["sampling_params"] = {**body.get("sampling_params", {}), **params}
    return replace(req, json=body)


def _scrub(text: str, addr: str) -> str:
    for form in (base_url(addr), addr):
        text = text.replace(form, "the vLLM server")
    return text


def _topk(entries: list[Any], k: int) -> TopK:
    """The ``k`` most likely tokens at each prompt position of vLLM's ``prompt_logprobs`` (rank 1 first)."""
    rows: TopK = [None]
    for i, entry in enumerate(entries[1:], start=1):
        ranked = []
        for tok, info in entry.items():
            rank = int(require(info, "rank", "vllm", f"prompt_logprobs[{i}].{tok}"))
            if rank <= k:
                ranked.append((rank, int(tok), float(info["logprob"])))
        rows.append([(tok, lp) for _, tok, lp in sorted(ranked)[:k]])
    return rows


class VLLMSampler:
    """Samples and prompt logprobs from one vLLM server, base model or a named adapter."""

    def __init__(self, addr: str, request_timeout: float = 600.0, base_dir: str = "") -> None:
        self.addr = addr
        # distinct per sampler, so two tinker-serve processes on one vLLM server never load the same adapter name
        self.tag = uuid.uuid4().hex[:8]
        # full-weight mode: (HF directory, save version) of the weights the server holds
        self.weights: tuple[str, int] = (base_dir, 0)
        self._readers = 0
        self._swap = asyncio.Condition()
        self.backend = get_backend(
            SAMPLER_BACKEND, request_timeout=request_timeout, control_timeout=60.0, update_timeout=300.0
        )
        self.http = HttpClient("tandemrl-tinker-sampler")
        self.loads: dict[str, int] = {}  # adapter name -> how many times it was loaded
        self.current: dict[str, tuple[int, str]] = {}  # adapter name -> (load, vLLM name) of its newest load
        self.users: dict[str, int] = {}  # vLLM adapter name -> samples using it now
        self.retired: set[str] = set()  # vLLM adapter names of replaced loads, still to unload
        self._unloads: set[asyncio.Task[None]] = set()

    async def _send(self, call: HttpRequest, retries: int) -> Any:
        try:
            return await self.http.send(self.addr, call, retries=retries)
        except InferenceServerError as err:
            message = _scrub(f"vLLM {call.path}: {err.detail}", self.addr)
            if err.status is not None and 400 <= err.status < 500:
                raise VLLMRejected(message) from None
            raise VLLMError(message) from None

    async def max_model_len(self) -> int:
        """The served model's context length (vLLM ``/v1/models``)."""
        reply = await self._send(HttpRequest("GET", "/v1/models", None, 60.0), retries=2)
        models = require_list(reply, "data", "vllm", "")
        return int(require(models[0], "max_model_len", "vllm", "data[0]"))

    async def load_adapter(self, name: str, path: str, reload: bool = True) -> None:
        """Load ``path`` as adapter ``name`` (under a new vLLM name); a name loaded before is loaded again unless
        ``reload`` is False."""
        if name in self.current and not reload:
            return
        load = self.loads[name] = self.loads.get(name, 0) + 1
        served = f"{name}@{self.tag}.{load}"
        body = {"lora_name": served, "lora_path": path}
        await self._send(HttpRequest("POST", "/v1/load_lora_adapter", body, 300.0), retries=0)
        old = self.current.get(name)
        if old is not None and old[0] > load:  # a later save of this name finished loading first
            self.retired.add(served)
        else:
            self.current[name] = (load, served)
            if old is not None:
                self.retired.add(old[1])
        self._unload_retired()

    @asynccontextmanager
    async def adapter(self, name: str | None) -> AsyncIterator[str | None]:
        """The vLLM model name of adapter ``name``'s newest load (None: the base model) while it is in use."""
        if name is None:
            yield None
            return
        served = self.current[name][1]
        self.users[served] = self.users.get(served, 0) + 1
        try:
            yield served
        finally:
            self.users[served] -= 1
            if not self.users[served]:
                del self.users[served]
                self._unload_retired()

    def _unload_retired(self) -> None:
        """Unload (in the background) every replaced load that no sample uses."""
        for served in [s for s in self.retired if s not in self.users]:
            self.retired.discard(served)
            task = asyncio.ensure_future(self._unload(served))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, served: str) -> None:
        call = HttpRequest("POST", "/v1/unload_lora_adapter", {"lora_name": served}, 60.0)
        try:
            await self._send(call, retries=0)
        except Exception as err:  # noqa: BLE001 - a failed unload leaves a name in vLLM's table, nothing more
            logger.warning("tinker-serve: unloading replaced adapter %s failed: %s", served, err)

    @asynccontextmanager
    async def full_weights(
        self, directory: str, version: int, merge: Callable[[str, str], None] | None = None
    ) -> AsyncIterator[None]:
        """Sample with the full weights saved to ``directory`` as save ``version``: load them (a vLLM disk update)
        once no sample of other weights is in flight; samples of the loaded weights run concurrently.

        ``merge(directory, out)``: ``directory`` holds an adapter; the base model merged with it is written to a
        temporary ``out``, loaded, and deleted (vLLM keeps the weights in memory).
        """
        want = (directory, version)
        async with self._swap:
            while self.weights != want and self._readers:
                await self._swap.wait()
            if self.weights != want:
                await self._load_full(directory, merge)
                self.weights = want
            self._readers += 1
        try:
            yield
        finally:
            async with self._swap:
                self._readers -= 1
                self._swap.notify_all()

    async def _load_full(self, directory: str, merge: Callable[[str, str], None] | None) -> None:
        if merge is None:
            for call in self.backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=directory)):
                await self._send(call, retries=0)
            return
        with tempfile.TemporaryDirectory(prefix="tinker-merged-") as out:
            await asyncio.to_thread(merge, directory, out)
            for call in self.backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=out)):
                await self._send(call, retries=0)

    async def _one(self, prompt: list[int], params: dict[str, Any], adapter: str | None, seed: int | None) -> Any:
        g = GenerationHyperparameters(
            max_new_tokens=int(params.get("max_tokens") or 16),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            greedy=float(params.get("temperature", 1.0)) == 0.0,
        )
        stop = params.get("stop")
        if isinstance(stop, str):
            g.stop = [stop]
        elif stop and all(isinstance(s, int) for s in stop):
            g.stop_token_ids = [int(s) for s in stop]
        elif stop:
            g.stop = [str(s) for s in stop]
        # stop=[] is the SDK's "no stop at all, not even EOS": generate until max_tokens
        req = ModelRequest(input_ids=list(prompt), gconfig=g, metadata={"seed": seed, "ignore_eos": stop == []})
        call = _with(self.backend.build_generate(req, [], g.max_new_tokens, 0), adapter)
        return self.backend.parse_generate(await self._send(call, retries=2))

    async def sample(
        self, prompt: list[int], n: int, params: dict[str, Any], adapter: str | None
    ) -> list[tuple[list[int], list[float], str]]:
        """``n`` samples from vLLM model ``adapter`` (``adapter()``'s name; None: the base model): (tokens, logprobs,
        "stop" | "length") each."""
        seed = params.get("seed")
        seeds = [None if seed is None else int(seed) + i for i in range(n)]
        chunks = await asyncio.gather(*(self._one(prompt, params, adapter, s) for s in seeds))
        return [(c.output_tokens, c.output_logprobs, "length" if c.stop_reason == "length" else "stop") for c in chunks]

    async def prompt_logprobs(self, prompt: list[int], adapter: str | None, topk: int = 0) -> tuple[list[float], TopK]:
        """Logprob of each of ``prompt[1:]`` given its prefix, and with ``topk`` > 0 the ``topk`` most likely tokens
        at every position (``[None]`` for the first, which has no prefix)."""
        call = self.backend.build_prompt_logprobs(list(prompt), uuid.uuid4().hex)
        call = _with(call, adapter, prompt_logprobs=topk) if topk else _with(call, adapter)
        reply = await self._send(call, retries=2)
        own = self.backend.parse_prompt_logprobs(reply, list(prompt))
        return own, _topk(reply["prompt_logprobs"], topk) if topk else []

    def close(self) -> None:
        self.http.close()
