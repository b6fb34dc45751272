"""The sampling side of ``tandemrl tinker-serve``: a LoRA-enabled vLLM server, one adapter name per saved sampler.

Requests are built by tandemrl's ``VLLMBackend`` (it never opens a socket) and sent by the
shared ``HttpClient``; a saved adapter is loaded under its own name (vLLM multi-LoRA), and a
sample names it as the request's ``model``. Every save reloads the adapter (``load_inplace``),
and its generate requests carry a prefix-cache salt of that load's version, so KV computed with
an earlier save of the same name is never reused. A failed vLLM call is reported without the
vLLM server's address (``VLLMError``; ``VLLMRejected`` when vLLM answered 4xx).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.inference import HttpRequest, ModelRequest, WeightUpdateMeta
from tandemrl.inference.backend import require, require_list
from tandemrl.inference.http import HttpClient, InferenceServerError, base_url
from tandemrl.inference.vllm import VLLMBackend
from tandemrl.tinker.wire import UserError

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
        # full-weight mode: (HF directory, save version) of the weights the server holds
        self.weights: tuple[str, int] = (base_dir, 0)
        self._readers = 0
        self._swap = asyncio.Condition()
        self.backend = VLLMBackend(request_timeout=request_timeout, control_timeout=60.0, update_timeout=300.0)
        self.http = HttpClient("tandemrl-tinker-sampler")
        self.versions: dict[str, int] = {}  # adapter name -> how many times it was loaded

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
        """Load ``path`` under ``name``; a name loaded before is loaded again in place unless ``reload`` is False."""
        if name in self.versions and not reload:
            return
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._send(HttpRequest("POST", "/v1/load_lora_adapter", body, 300.0), retries=0)
        self.versions[name] = self.versions.get(name, 0) + 1

    @asynccontextmanager
    async def full_weights(self, directory: str, version: int) -> AsyncIterator[None]:
        """Sample with the full weights saved to ``directory`` as save ``version``: load them (a vLLM disk update)
        once no sample of other weights is in flight; samples of the loaded weights run concurrently."""
        want = (directory, version)
        async with self._swap:
            while self.weights != want and self._readers:
                await self._swap.wait()
            if self.weights != want:
                for call in self.backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=directory)):
                    await self._send(call, retries=0)
                self.weights = want
            self._readers += 1
        try:
            yield
        finally:
            async with self._swap:
                self._readers -= 1
                self._swap.notify_all()

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
        version = self.versions.get(adapter, 0) if adapter is not None else 0
        call = _with(self.backend.build_generate(req, [], g.max_new_tokens, version), adapter)
        return self.backend.parse_generate(await self._send(call, retries=2))

    async def sample(
        self, prompt: list[int], n: int, params: dict[str, Any], adapter: str | None
    ) -> list[tuple[list[int], list[float], str]]:
        """``n`` samples: (tokens, logprobs, "stop" | "length") each."""
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
