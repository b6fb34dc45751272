"""Rollout throughput: ``RemoteInferenceClient.agenerate`` vs bare aiohttp requests to the same vLLM server.

Both paths send the same prompts with the same sampling parameters to
``/inference/v1/generate`` at the same concurrency, so the ratio is the client's overhead
(request building, the shared HTTP event-loop thread, response parsing, version
labelling). Rounds alternate the two paths so machine noise hits both alike. Figures
are printed, never asserted.

    python bench/rollout_throughput.py                        # starts a tiny-model vLLM server (~1-2 min)
    python bench/rollout_throughput.py --addr 127.0.0.1:8000  # an already running server
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tandemrl.utils.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--addr", default=None, help="host:port of a running vLLM server; default: start one.")
    ap.add_argument("--model", default=None, help="HF model dir for the started server; default: the tiny Qwen2.")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K dir the tiny model's tokenizer is built from.")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the started server.")
    ap.add_argument("--prompts", type=int, default=64, help="Requests per round.")
    ap.add_argument("--concurrency", type=int, default=32, help="Requests in flight at once.")
    ap.add_argument("--new-tokens", type=int, default=64, help="Generated tokens per request (EOS ignored).")
    ap.add_argument("--prompt-len", type=int, default=32, help="Random prompt tokens per request.")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3, help="Timed rounds per path (alternating).")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for name in ("prompts", "concurrency", "new_tokens", "prompt_len", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def tiny_model(data: str) -> str:
    """The tests' cached tiny Qwen2 (built on first use)."""
    from tandemrl.models.make_tiny import ensure_tiny_model

    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    corpus = data if os.path.isdir(data) else None
    return ensure_tiny_model(Path(root).expanduser() / "tiny-models", "qwen2", corpus_path=corpus)


def served_model(addr: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{addr}/v1/models", timeout=30) as r:
        return str(json.load(r)["data"][0]["id"])


def make_prompts(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(a.seed)
    return [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]


def sampling_params(a: argparse.Namespace) -> dict[str, Any]:
    """What the client's vLLM backend sends for these settings (see ``VLLMBackend.build_generate``)."""
    return {
        "n": 1,
        "max_tokens": a.new_tokens,
        "min_tokens": 0,
        "temperature": a.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "stop_token_ids": [],
        "frequency_penalty": 0.0,
        "logprobs": 0,
        "detokenize": False,
        "ignore_eos": True,
    }


async def bounded(n: int, concurrency: int, one: Callable[[int], Awaitable[int]]) -> int:
    """Run ``one(i)`` for i < n with at most ``concurrency`` in flight; total tokens returned."""
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with sem:
            return await one(i)

    return sum(await asyncio.gather(*(run(i) for i in range(n))))


async def direct_round(a: argparse.Namespace, addr: str, prompts: list[list[int]], tag: str) -> int:
    """Bare aiohttp: one session, the same JSON bodies, token count from the reply."""
    import aiohttp

    params = sampling_params(a)
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> int:
            body = {"request_id": f"{tag}-{i}", "token_ids": prompts[i], "sampling_params": params, "stream": False}
            async with session.post(f"http://{addr}/inference/v1/generate", json=body) as resp:
                resp.raise_for_status()
                payload = await resp.json()
            return len(payload["choices"][0]["token_ids"])

        return await bounded(len(prompts), a.concurrency, one)


async def client_round(a: argparse.Namespace, engine: Any, prompts: list[list[int]], tag: str) -> int:
    from tandemrl.api.inference import ModelRequest

    async def one(i: int) -> int:
        req = ModelRequest(rid=f"{tag}-{i}", input_ids=prompts[i], metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(max_new_tokens=a.new_tokens, temperature=a.temperature)
        resp = await engine.agenerate(req)
        return resp.output_len

    return await bounded(len(prompts), a.concurrency, one)


def timed(coro_fn: Callable[[], Awaitable[int]]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = asyncio.run(coro_fn())
    return tokens, time.perf_counter() - start


def run(a: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from tandemrl.configs.rollout import InferenceClientConfig
    from tandemrl.inference.remote import RemoteInferenceClient

    server = None
    model = a.model
    if a.addr is None:
        from tandemrl.inference.server import launch_server
        from tandemrl.inference.vllm import VLLMBackend

        model = model or tiny_model(a.data)
        extra = {"max_model_len": max(1024, a.prompt_len + a.new_tokens), "dtype": a.dtype}
        server = launch_server(VLLMBackend(), model, extra=extra)
        print(f"starting vLLM on {model} (log {server.log_file}) ...", flush=True)
        print(f"server healthy after {server.wait_healthy(900):.0f}s", flush=True)
        addr = server.address
    else:
        addr = a.addr
    engine = None
    try:
        if model is None:  # a running server: it serves the model under its path
            model = served_model(addr)
        vocab = int(AutoConfig.from_pretrained(model).vocab_size)
        prompts = make_prompts(a, vocab)
        # The rollout defaults (request_retries=3: the keep-alive session that generation uses in training;
        # request_retries=0 would open a new connection per request).
        engine = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(setup_timeout=60.0))
        engine.initialize([addr])
        print(
            f"server {addr} model {model}\n{a.prompts} prompts x {a.prompt_len} tokens, {a.new_tokens} new tokens, "
            f"concurrency {a.concurrency}, temperature {a.temperature}, {a.rounds} rounds per path"
        )
        # Warm-up: one small round each (connections, server-side caches).
        timed(lambda: direct_round(a, addr, prompts[: a.concurrency], "warm-direct"))
        timed(lambda: client_round(a, engine, prompts[: a.concurrency], "warm-client"))
        rates: dict[str, list[float]] = {"direct aiohttp": [], "RemoteInferenceClient": []}
        expected = a.prompts * a.new_tokens
        print(f"\n{'round':>5}  {'path':<16}{'tokens':>8}{'seconds':>9}{'tok/s':>9}")
        for r in range(a.rounds):
            for name in (
                ("direct aiohttp", "RemoteInferenceClient")
                if r % 2 == 0
                else ("RemoteInferenceClient", "direct aiohttp")
            ):
                if name == "direct aiohttp":
                    tokens, secs = timed(lambda r=r: direct_round(a, addr, prompts, f"d{r}"))
                else:
                    tokens, secs = timed(lambda r=r: client_round(a, engine, prompts, f"c{r}"))
                if tokens != expected:
                    raise SystemExit(f"{name} round {r}: {tokens} tokens generated, expected {expected}")
                rates[name].append(tokens / secs)
                print(f"{r:>5}  {name:<16}{tokens:>8}{secs:>9.2f}{tokens / secs:>9.0f}")
        direct, client = statistics.median(rates["direct aiohttp"]), statistics.median(rates["RemoteInferenceClient"])
        print(f"\nmedian tok/s: direct aiohttp {direct:.0f}, RemoteInferenceClient {client:.0f}")
        print(f"ratio of the medians RemoteInferenceClient / direct: {client / direct:.3f}")
        paired = [c / d for c, d in zip(rates["RemoteInferenceClient"], rates["direct aiohttp"], strict=True)]
        print(f"median of the per-round ratios (back-to-back pairs): {statistics.median(paired):.3f}")
    finally:
        if engine is not None:
            engine.destroy()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("rollout_throughput"):
        run(parse_args())
