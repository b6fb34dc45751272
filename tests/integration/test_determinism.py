"""Deterministic mode: per-request seeds, submission-order batches, the pull schedule, drain, torch
settings, the seed fields of both request builders, and the real vLLM server's seeded sampling.

The executor tests use an in-process stand-in for the server (a seeded sampler with random
delays, so completion order varies); the vLLM test uses the session server.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tandemrl.api.determinism import RolloutKey, request_seed, rollout_key_context, sample_seed
from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.data.loader import collate_as_list
from tandemrl.inference.sglang import SGLangBackend
from tandemrl.inference.vllm import VLLMBackend
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.trainers.determinism import enable_determinism
from tandemrl.workflows.rlvr import RLVRWorkflow

WAIT = 30.0  # generous bound on waits that only matter when something is broken


def test_sample_seed_is_a_stable_hash_of_every_part() -> None:
    assert sample_seed(1, 0, 5, 0, 2, 0) == sample_seed(1, 0, 5, 0, 2, 0)
    assert sample_seed(1, 0, 5, 0, 2, 0) == 246801125  # the same in every process and run
    base = (1, 0, 5, 0, 2, 0)
    variants = {sample_seed(*base[:i], base[i] + 1, *base[i + 1 :]) for i in range(len(base))}
    assert len(variants) == len(base) and sample_seed(*base) not in variants
    assert all(0 <= s < 2**31 for s in variants)


def test_request_seed_needs_the_row_id_and_a_rollout_key() -> None:
    assert request_seed(None, {}, 0) is None  # deterministic mode off: no seed, no requirement
    with pytest.raises(RuntimeError, match="WorkflowExecutor"):
        request_seed(1, {"id": 3}, 0)
    ctx = rollout_key_context(RolloutKey(4, attempt=1))
    assert ctx.run(request_seed, 1, {"id": 3}, 2) == sample_seed(1, 4, 3, 1, 2, 0)
    with pytest.raises(ValueError, match="row field 'id' must be the row's integer index"):
        ctx.run(request_seed, 1, {"question": "q"}, 0)


def test_both_request_builders_send_the_seed() -> None:
    req = ModelRequest(input_ids=[1, 2], metadata={"seed": 77})
    vllm = VLLMBackend().build_generate(req, [], remaining=4, version=0).json
    sglang = SGLangBackend().build_generate(req, [], remaining=4, version=0).json
    assert vllm is not None and sglang is not None
    assert vllm["sampling_params"]["seed"] == 77 and sglang["sampling_params"]["sampling_seed"] == 77
    plain = SGLangBackend().build_generate(ModelRequest(input_ids=[1]), [], remaining=4, version=0).json
    assert plain is not None and "sampling_seed" not in plain["sampling_params"]


def test_enable_determinism_sets_torch_and_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        enable_determinism(5)
        assert torch.are_deterministic_algorithms_enabled()
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        first = torch.rand(3)
        enable_determinism(5)
        assert torch.equal(first, torch.rand(3))
    finally:
        torch.use_deterministic_algorithms(False)


class SeededEngine:
    """A batch-invariant seeded sampler: tokens and logprobs depend only on the request's seed;
    each request returns after a random delay, so completion order changes from run to run."""

    def __init__(self, delay_seed: int) -> None:
        self.version = 0
        self.delays = random.Random(delay_seed)
        self.seeds: list[int] = []
        self.gate = threading.Event()
        self.gated: set[int] = set()  # first prompt tokens held until ``gate`` is set
        self.lock = threading.Lock()

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        seed = req.metadata["seed"]
        with self.lock:
            self.seeds.append(seed)
        while req.input_ids[0] in self.gated and not self.gate.is_set():
            await asyncio.sleep(0.002)
        await asyncio.sleep(self.delays.uniform(0, 0.004))
        rng = random.Random(seed)
        n = rng.randint(1, 4)
        tokens = [rng.randrange(10, 60) for _ in range(n)]
        return ModelResponse(list(req.input_ids), tokens, [-rng.random() for _ in tokens], [self.version] * n)


class _Tok:
    """The tokenizer surface RLVRWorkflow uses: a prompt's first token is its row id."""

    eos_token_id = 0

    def apply_chat_template(self, messages: Any, **_: Any) -> str:
        return str(messages[0]["content"])

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [int(text) + 100, 1, 2]}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]


def _executor(engine: SeededEngine, k: int, bsz: int) -> WorkflowExecutor:
    ex = WorkflowExecutor(InferenceClientConfig(max_head_offpolicyness=k), engine, bsz, deterministic=True)
    ex.initialize()
    return ex


def _workflow() -> RLVRWorkflow:
    def reward(completions: str, **_: Any) -> float:
        return float(len(completions) % 3)

    return RLVRWorkflow(reward, GenerationHyperparameters(n_samples=3), _Tok(), stat_scope="test-det", seed=9)


def _async_run(delay_seed: int, steps: int = 3, k: int = 1, bsz: int = 2) -> list[dict[str, torch.Tensor]]:
    """``steps`` of prepare_batch with a weight push (drain, then version + 1) after each."""
    engine = SeededEngine(delay_seed)
    ex = _executor(engine, k, bsz)
    loader = StatefulDataLoader(_rows(12), batch_size=bsz, collate_fn=collate_as_list)
    try:
        batches = []
        for step in range(steps):
            batches.append(ex.prepare_batch(loader, _workflow(), timeout=WAIT))
            ex.drain(timeout=WAIT)
            ex.pause()
            ex.set_version(step + 1)
            ex.resume()
        return batches
    finally:
        ex.destroy()


def test_deterministic_prepare_batch_is_independent_of_completion_order() -> None:
    first, second = _async_run(delay_seed=1), _async_run(delay_seed=2)
    for a, b in zip(first, second, strict=True):
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[key], b[key]) for key in a)
    # Batches are the rows in submission order, two per step; with k = 1 step s > 0 trains on the
    # batch generated whole at version s - 1.
    ids = [batch["input_ids"][::3, 0].tolist() for batch in first]
    assert ids == [[100, 101], [102, 103], [104, 105]]
    versions = [int(b["versions"][b["loss_mask"].bool()].max()) for b in first]
    assert versions == [0, 0, 1]


def test_batches_wait_for_the_earliest_submitted_row_and_drain_waits_for_all() -> None:
    engine = SeededEngine(delay_seed=3)
    engine.gated = {100}  # row 0 holds; rows 1..3 (this batch and the next, k = 1) finish
    ex = _executor(engine, k=1, bsz=2)
    loader = StatefulDataLoader(_rows(8), batch_size=2, collate_fn=collate_as_list)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(batch=ex.prepare_batch(loader, _workflow())))
    try:
        thread.start()
        deadline = time.monotonic() + WAIT
        while ex.get_stats().accepted < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.get_stats().accepted == 3 and ex.get_stats().running == 1
        assert thread.is_alive() and "batch" not in box  # finished rows are not handed out past row 0
        # Two batches (v + k + 1 at version 0) were taken from the dataloader, no more.
        assert [r["id"] for r in ex.pending_rows()] == [0, 1, 2, 3]
        with pytest.raises(TimeoutError, match="drain"):
            ex.drain(timeout=0.2)
        engine.gate.set()
        thread.join(WAIT)
        assert box["batch"]["input_ids"][::3, 0].tolist() == [100, 101]
        ex.drain(timeout=WAIT)
        assert [r["id"] for r in ex.pending_rows()] == [2, 3] and ex.get_stats().running == 0
    finally:
        engine.gate.set()
        ex.destroy()


def test_rollout_batch_seeds_follow_rows_not_timing() -> None:
    runs = []
    for delay_seed in (4, 5):
        engine = SeededEngine(delay_seed)
        ex = _executor(engine, k=0, bsz=4)
        try:
            batch = ex.rollout_batch(_rows(4), _workflow(), timeout=WAIT)
        finally:
            ex.destroy()
        runs.append((batch, sorted(engine.seeds)))
    (a, seeds_a), (b, seeds_b) = runs
    assert seeds_a == seeds_b and len(set(seeds_a)) == 12  # one distinct seed per sample
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow
def test_vllm_seeded_sampling_is_batch_invariant(vllm_server: Any) -> None:
    """The measured behaviour deterministic mode relies on: the CPU vLLM server returns the same
    tokens and logprobs (bitwise) for a seeded request alone or batched with others; the seed matters."""
    backend = vllm_server.backend

    def generate(prompt: list[int], seed: int, n: int = 24) -> tuple[list[int], list[float]]:
        req = ModelRequest(input_ids=prompt, metadata={"seed": seed, "ignore_eos": True})
        chunk = backend.parse_generate(vllm_server.call(backend.build_generate(req, [], n, 0)))
        return chunk.output_tokens, chunk.output_logprobs

    prompts = [[5, 17, 33, 80, 12], [9, 9, 40, 41, 42, 43, 100, 7], [200, 3, 4]]
    alone = [generate(p, 1000 + i) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(12) as pool:
        mine = [pool.submit(generate, p, 1000 + i) for i, p in enumerate(prompts)]
        others = [pool.submit(generate, [50 + j, 60, 70], 7 + j, 8 + 4 * j) for j in range(8)]
        batched = [f.result() for f in mine]
        [f.result() for f in others]
    assert batched == alone
    assert generate(prompts[0], 1000) == alone[0]
    assert generate(prompts[0], 1001)[0] != alone[0][0]
