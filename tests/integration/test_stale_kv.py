"""No KV computed under old weights is served after a weight update (the session vLLM server, all ``slow``).

vLLM's prefix cache keys a KV block by its tokens, not by the weights that computed it: a prompt
whose first block was cached before an update would, without a flush, be served from old-weight
KV after it. Each test caches such a prefix under the original weights (and checks that a request
hits it), pushes new weights through ``RemoteInferenceClient`` (disk, collective broadcast, or disk with
a request interrupted by the update), then compares the served greedy tokens and logprobs with those
of the same server after the test's own ``/reset_prefix_cache`` (a cold server on the new weights):
exactly equal (token ids and logprobs), while the old weights' logprobs differ from them by more than
``MIN_SHIFT``; after a disk or collective update the reply also says no prompt token came from the cache.
The comparison is exact because both sides are the same cold prefill on the same server.

The server runs with ``--enable-prompt-tokens-details``: each reply's ``usage`` says how many prompt
tokens came from the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from utils import free_port
from vllm_server import VLLMTestServer, perturbed_model, restore_original

from tandemrl.api.inference import HttpRequest, ModelRequest, WeightUpdateMeta
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.weights.group import destroy_group, host_group
from tandemrl.weights.wire import broadcast_buckets, pack_bucket, split_buckets

NEW_TOKENS = 8
MIN_SHIFT = 0.5  # the new weights move some greedy logprob by more than this (measured: several nats)


@dataclass
class Reply:
    tokens: list[int]
    logprobs: list[float]
    cached: int | None  # prompt tokens served from the prefix cache (None: not reported)


def generate(server: VLLMTestServer, prompt: list[int], n: int, version: int = 0) -> Reply:
    """``n`` greedy tokens of ``prompt`` with their logprobs, and how many prompt tokens hit the cache;
    sent as a client at weight ``version`` sends it (the prefix cache is salted with it)."""
    req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(prompt), metadata={"ignore_eos": True})
    req.gconfig = req.gconfig.new(greedy=True)
    payload = server.call(server.backend.build_generate(req, [], n, version))
    chunk = server.backend.parse_generate(payload)
    cached = int(payload["usage"]["prompt_tokens_details"]["cached_tokens"])
    return Reply(chunk.output_tokens, chunk.output_logprobs, cached)


def cold(server: VLLMTestServer, prompt: list[int], n: int) -> Reply:
    """The oracle: the same server with its whole prefix cache dropped by the test itself."""
    assert server.call(HttpRequest("POST", "/reset_prefix_cache", None, 60.0)) == {"success": True}
    reply = generate(server, prompt, n)
    assert reply.cached == 0
    return reply


def block_size(server: VLLMTestServer) -> int:
    info = server.call(server.backend.build_lora_probe())  # the dev-mode /server_info
    return int(info["vllm_config"]["cache_config"]["block_size"])


def random_prompt(server: VLLMTestServer, length: int, seed: int) -> list[int]:
    vocab = json.loads(Path(server.model_dir, "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def assert_served_cold(served: Reply, oracle: Reply, old: Reply) -> None:
    """``served`` is exactly what a cold server on the new weights serves, and that is not what the
    old weights serve (so stale KV would show)."""
    assert (served.tokens, served.logprobs) == (oracle.tokens, oracle.logprobs), (
        f"after the update the server served {served.tokens} {served.logprobs} (prompt tokens from cache: "
        f"{served.cached}); a cold server on the new weights serves {oracle.tokens} {oracle.logprobs}"
    )
    shift = max(abs(a - b) for a, b in zip(old.logprobs, oracle.logprobs, strict=True))
    print(f"old vs new weights: max |logprob diff| {shift:.3f}")
    assert shift > MIN_SHIFT, f"the new weights moved the logprobs by only {shift:.3f}"


@contextlib.contextmanager
def engine_on(server: VLLMTestServer, **config: Any) -> Iterator[RemoteInferenceClient]:
    """A client on the session server (``config``: InferenceClientConfig fields); afterwards the server
    has its original weights and label."""
    label = server.call(HttpRequest("GET", "/weight_info", None, 60.0))["weight_version"]
    eng = RemoteInferenceClient.for_backend(
        "vllm", InferenceClientConfig(request_retries=1, setup_timeout=60.0, **config)
    )
    eng.initialize([server.proc.address])
    try:
        yield eng
    finally:
        eng.destroy()
        restore_original(server)
        server.call(HttpRequest("POST", "/update_weight_version", {"new_version": str(label)}, 60.0))


@pytest.fixture
def engine(vllm_server: VLLMTestServer) -> Iterator[RemoteInferenceClient]:
    with engine_on(vllm_server) as eng:
        yield eng


def warm_prefix(server: VLLMTestServer, seed: int) -> tuple[list[int], Reply]:
    """A prompt one and a quarter KV blocks long, its first block cached under the original weights."""
    block = block_size(server)
    prompt = random_prompt(server, block + block // 4, seed)
    first, again = generate(server, prompt, NEW_TOKENS), generate(server, prompt, NEW_TOKENS)
    assert first.cached == 0 and again.cached == block, (first.cached, again.cached, block)
    gap = max(abs(a - b) for a, b in zip(first.logprobs, again.logprobs, strict=True))
    print(
        f"\ncached vs cold prefix, same weights: tokens equal {first.tokens == again.tokens}, max |logprob diff| {gap}"
    )
    return prompt, again


def push_from_disk(engine: RemoteInferenceClient, model_dir: str, out: Path) -> None:
    perturbed_model(model_dir, seed=7, out_dir=out)
    engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path=str(out), version=1)).result()


@contextlib.contextmanager
def joined_group(engine: RemoteInferenceClient, new: torch.nn.Module) -> Iterator[Callable[[], None]]:
    """Yields the update that broadcasts ``new`` (version 1). The trainer's side is this process: rank 0
    of a 2-rank gloo group with the server, joined before the yield and left after it."""
    meta = WeightUpdateMeta(type="collective", group_port=free_port(), world_size=2, comm_backend="gloo", version=1)
    joined = engine.init_weights_update_group(meta)
    pg = host_group(meta.group_addr, meta.group_port, meta.world_size, meta.comm_backend, 120)
    try:
        joined.result(timeout=120)
        buckets = list(split_buckets(new.state_dict().items(), bucket_bytes=1 << 20))

        def update() -> None:
            received = engine.update_weights_from_distributed(meta, [pack_bucket(b)[1] for b in buckets])
            broadcast_buckets(pg, buckets)
            received.result(timeout=120)

        yield update
    finally:
        engine.leave_weights_update_group(meta).result(timeout=120)
        destroy_group(pg)


def push_by_broadcast(engine: RemoteInferenceClient, model_dir: str, out: Path) -> None:
    with joined_group(engine, perturbed_model(model_dir, seed=8)) as update:
        update()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("push", "seed"), [(push_from_disk, 101), (push_by_broadcast, 102)], ids=["disk", "collective"]
)
def test_update_serves_no_stale_prefix(
    vllm_server: VLLMTestServer, engine: RemoteInferenceClient, tmp_path: Path, push: Callable[..., None], seed: int
) -> None:
    prompt, old = warm_prefix(vllm_server, seed)
    push(engine, vllm_server.model_dir, tmp_path / "new")
    served = generate(vllm_server, prompt, NEW_TOKENS)
    assert_served_cold(served, cold(vllm_server, prompt, NEW_TOKENS), old)
    assert served.cached == 0


@pytest.mark.slow
def test_request_interrupted_by_update_is_resumed_without_stale_kv(
    vllm_server: VLLMTestServer, engine: RemoteInferenceClient, tmp_path: Path
) -> None:
    """A greedy request is held after ``k`` tokens, paused (abort), the weights updated from disk, resumed.
    The first KV block ends inside the tokens generated before the pause and was cached under the old
    weights; the tokens after the update are exactly a cold server's on the new weights from that point."""
    block = block_size(vllm_server)
    prompt = random_prompt(vllm_server, block - block // 16, seed=103)
    k, n = block // 8, block // 8 + NEW_TOKENS
    # Before the update: the old weights' greedy path, and the block of prompt + its first tokens is cached.
    path = generate(vllm_server, prompt, n)
    assert generate(vllm_server, prompt + path.tokens[:k], 1).cached == block
    perturbed_model(vllm_server.model_dir, seed=9, out_dir=tmp_path / "new")

    async def interrupted() -> tuple[list[int], list[float], list[int]]:
        req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(prompt), metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(greedy=True, max_new_tokens=n)
        with vllm_server.gate(prompt) as gate:  # tests/vllm_gate.py: the request waits between tokens
            task = asyncio.ensure_future(engine.agenerate(req))
            held = await asyncio.to_thread(gate.wait_held)
            held = await asyncio.to_thread(gate.advance, held, k)
            await asyncio.to_thread(gate.release_until, engine.pause_generation, held, n - 1)
        meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "new"), version=1)
        await asyncio.to_thread(lambda: engine.update_weights_from_disk(meta).result())
        await asyncio.to_thread(engine.continue_generation)
        resp = await task
        return resp.output_tokens, resp.output_logprobs, resp.output_versions

    tokens, logprobs, versions = asyncio.run(interrupted())
    m = versions.index(1)  # tokens generated before the update
    assert k <= m < n and versions == [0] * m + [1] * (n - m), versions
    assert tokens[:m] == path.tokens[:m]  # the old weights' path, whose first block was cached
    served = Reply(tokens[m:], logprobs[m:], None)
    old = Reply(path.tokens[m:], path.logprobs[m:], None)
    assert_served_cold(served, cold(vllm_server, prompt + tokens[:m], n - m), old)
