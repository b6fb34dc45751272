"""The sampling side of ``tandemrl tinker-serve``: a LoRA-enabled vLLM server, one adapter name per saved sampler.

Requests are built by tandemrl's ``VLLMBackend`` (it never opens a socket) and sent by the
shared ``HttpClient``; a saved adapter is loaded under its own name (vLLM multi-LoRA), and a
sample names it as the request's ``model``.
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
from tandemrl.inference.http import HttpClient
from tandemrl.inference.vllm import VLLMBackend


def _with_model(req: HttpRequest, adapter: str | None) -> HttpRequest:
    if adapter is None:
        return req
    return replace(req, json={**(req.json or {}), "model": adapter})


class VLLMSampler:
    """Samples and prompt logprobs from one vLLM server, base model or a named adapter."""

    def __init__(self, addr: str, request_timeout: float = 600.0, base_dir: str = "") -> None:
        self.addr = addr
        self.weights_dir = base_dir  # full-weight mode: the HF directory the server's weights came from
        self._readers = 0
        self._swap = asyncio.Condition()
        self.backend = VLLMBackend(request_timeout=request_timeout, control_timeout=60.0, update_timeout=300.0)
        self.http = HttpClient("tandemrl-tinker-sampler")
        self.loaded: set[str] = set()

    async def load_adapter(self, name: str, path: str) -> None:
        if name in self.loaded:
            return
        body = {"lora_name": name, "lora_path": path}
        await self.http.send(self.addr, HttpRequest("POST", "/v1/load_lora_adapter", body, 300.0), retries=0)
        self.loaded.add(name)

    @asynccontextmanager
    async def full_weights(self, directory: str) -> AsyncIterator[None]:
        """Sample with the full weights of ``directory``: load them (a vLLM disk update) once no sample of other
        weights is in flight; samples of the loaded weights run concurrently."""
        async with self._swap:
            while self.weights_dir != directory and self._readers:
                await self._swap.wait()
            if self.weights_dir != directory:
                for call in self.backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=directory)):
                    await self.http.send(self.addr, call, retries=0)
                self.weights_dir = directory
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
        req = ModelRequest(input_ids=list(prompt), gconfig=g, metadata={"seed": seed})
        call = _with_model(self.backend.build_generate(req, [], g.max_new_tokens, 0), adapter)
        return self.backend.parse_generate(await self.http.send(self.addr, call, retries=2))

    async def sample(
        self, prompt: list[int], n: int, params: dict[str, Any], adapter: str | None
    ) -> list[tuple[list[int], list[float], str]]:
        """``n`` samples: (tokens, logprobs, "stop" | "length") each."""
        seed = params.get("seed")
        seeds = [None if seed is None else int(seed) + i for i in range(n)]
        chunks = await asyncio.gather(*(self._one(prompt, params, adapter, s) for s in seeds))
        return [(c.output_tokens, c.output_logprobs, "length" if c.stop_reason == "length" else "stop") for c in chunks]

    async def prompt_logprobs(self, prompt: list[int], adapter: str | None) -> list[float]:
        """Logprob of each of ``prompt[1:]`` given its prefix."""
        call = _with_model(self.backend.build_prompt_logprobs(list(prompt), uuid.uuid4().hex), adapter)
        return self.backend.parse_prompt_logprobs(await self.http.send(self.addr, call, retries=2), list(prompt))

    def close(self) -> None:
        self.http.close()
