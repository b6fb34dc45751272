"""Trainer <-> real vLLM acceptance tests of the rollout path (all ``slow``).

* the trainer (FSDPEngine, 2 gloo ranks under torchrun) recomputes the server's
  behaviour logprobs at the sampling temperature, and under top-p/top-k sampling with
  ``truncation_replay`` (unbiased ratios; biased without it);
* ``RolloutController.push_weights`` from an FSDP engine by disk (tiny model, bf16 session server) and by bucketed
  collective broadcast (a ~25M-parameter model on its own fp32 server) makes the server's
  greedy output equal transformers' greedy output on the engine's exported weights;
* a collective update the server rejects fails with a clear error and leaves the server
  updatable;
* a long generation interrupted by a weight update carries both versions, and each
  token's logprob matches the weights that sampled it;
* killing a real server mid-rollout: rollouts finish on the survivor, none lost or
  duplicated; with no survivor a one-line error comes within the configured timeout.

The session server (``vllm_server``) is left with its original weights, version label and
unpaused. The extra 25M server is launched when the module starts (if a selected test
needs it), so its ~100 s start overlaps the tiny-server tests; the kill test ends it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gsm8k_path, tiny_model_cache_dir
from utils import free_port, run_torchrun
from vllm_server import (
    VLLMTestServer,
    assert_greedy_matches,
    decisive_prompt,
    hf_greedy,
    join,
    launch_test_server,
    load_hf,
    restore_session_server,
    weight_label,
)

from tandemrl.api.inference import HttpRequest, ModelRequest, ModelResponse, WeightUpdateMeta
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.http import HttpClient
from tandemrl.inference.remote import RemoteInferenceClient, ServerUnavailableError
from tandemrl.inference.server import ServerProcess
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.weights.group import destroy_group, host_group
from tandemrl.weights.wire import broadcast_buckets, pack_bucket, split_buckets

WORKER = Path(__file__).resolve().parents[1] / "workers" / "sync_checks.py"
WORKER_ENV = {"TANDEMRL_DIST_TIMEOUT": "300"}  # a hung collective fails after 5 min, not 30
LOGPROB_TOL = 0.02  # mean |server - recomputed| logprob, bf16 server vs fp32 trainer
# top_p=0.8, top_k=20, fp32 server and trainer (docs/truncated_sampling.md has the measured values).
TRUNCATED_TOL = 1e-4  # with the replay: mean |trainer - server| logprob and |mean ratio - 1|
TRUNCATED_OUTSIDE = 0.01  # with the replay: tokens outside the trainer's kept set
FULL_VOCAB_MAX_RATIO = 0.5  # without the replay: the mean ratio exp(trainer - server) is below this
# ~25M parameters: 8 layers of ~3M (hidden 512, MLP 1536) + 2 x 0.5M embeddings.
BIG_MODEL = {"hidden": 512, "layers": 8, "intermediate": 1536, "heads": 8, "kv_heads": 2}
BIG_TESTS = (
    "test_truncated_sampling_ratios_are_unbiased_with_the_replay",
    "test_collective_update_25m_model_in_buckets",
    "test_killed_server_mid_rollout_fails_over",
)
TOP_PROMPTS = 8  # compared on a bf16 server: the prompts whose greedy paths have the widest top-2 logit gaps


# ------------------------------------------------------------------------------ helpers


def run_worker(mode: str, model: str, server: VLLMTestServer, out: Path, *extra: str) -> None:
    start = time.perf_counter()
    args = [mode, "--model", model, "--addr", server.proc.address, "--out", str(out), *extra]
    run_torchrun(WORKER, nproc=2, args=args, env=WORKER_ENV, timeout=600)
    print(f"\n{mode} worker ({Path(model).name}): {time.perf_counter() - start:.1f}s")


def random_prompts(vocab: int, seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, 8), generator=g).tolist()


def check_update_record(
    out: Path, prompts: list[list[int]], sync: str, fp32_server: bool, version: int = 1
) -> dict[str, Any]:
    """The update changed the server's greedy outputs, which now equal fp32 transformers'
    greedy outputs on the engine's exported weights.

    An fp32 server must match on every prompt without an exact near-tie; a bf16 server
    only on the ``TOP_PROMPTS`` prompts with the widest top-2 logit gaps (its rounding
    flips near-ties of the near-uniform tiny model).
    """
    record = torch.load(out / "update.pt")
    print(f"{sync} update: {record['update_seconds']:.2f}s, SFT losses {record['losses']}, pusher {record['sync']}")
    # The pusher's weight_sync/* figures: every exported byte moved (written, or broadcast whole).
    n_bytes = sum(p.numel() * p.element_size() for p in load_hf(str(out / "exported")).parameters())
    assert record["sync"]["bytes"] == record["sync"]["full_bytes"] >= n_bytes and record["sync"]["seconds"] > 0
    assert record["losses"][-1] < record["losses"][0], "the SFT steps did not change the model"
    before, after = record["before"], record["after"]
    refs = hf_greedy(load_hf(str(out / "exported")), prompts, len(after[0]))
    n_exact = sum(a == r.ids for r, a in zip(refs, after, strict=True))
    print(f"{sync}: server greedy == HF greedy on {n_exact}/{len(prompts)} prompts")
    if fp32_server:
        compared = [i for i, r in enumerate(refs) if r.min_gap > 1e-3]
        assert len(compared) >= len(prompts) * 3 // 4
    else:
        compared = sorted(range(len(prompts)), key=lambda i: refs[i].min_gap, reverse=True)[:TOP_PROMPTS]
        print(
            f"{sync}: smallest top-2 logit gap of the {TOP_PROMPTS} compared prompts {refs[compared[-1]].min_gap:.3f}"
        )
    for i in compared:
        assert after[i] == refs[i].ids, (
            f"prompt {i}: server greedy {after[i]} != HF greedy {refs[i].ids} after the update"
        )
    # Not trivially true: the outputs differ across prompts and from the server's before the update.
    assert len({tuple(refs[i].ids) for i in compared}) >= len(compared) // 2
    changed = sum(b != r.ids for b, r in zip(before, refs, strict=True))
    assert changed >= len(prompts) // 2, f"the update changed only {changed}/{len(prompts)} greedy outputs"
    label = str(version)
    assert record["label_before"] != label and record["label_after"] == label and record["client_version"] == version
    # push_weights set the engine's and the client's version on every trainer rank, not only the sender.
    assert record["rank_versions"] == [(version, version)] * 2, record["rank_versions"]
    return record


def big_model_dir() -> str:
    from tandemrl.models.make_tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache_dir(), "qwen2", corpus_path=str(gsm8k_path()), **BIG_MODEL)


@pytest.fixture(scope="module", autouse=True)
def big_server_proc(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess | None]:
    """Launch (without waiting) the 25M-model server when the module starts, if a selected test needs it."""
    items = [i for i in request.session.items if i.module is request.module]
    if not any(i.originalname in BIG_TESTS for i in items if isinstance(i, pytest.Function)):
        yield None
        return
    log = tmp_path_factory.mktemp("vllm-big") / "server.log"
    # fp32: the trainer's fp32 weights arrive exactly, so greedy equality holds on every prompt.
    proc = launch_test_server(big_model_dir(), str(log), dtype="float32")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def big_server(big_server_proc: ServerProcess | None) -> VLLMTestServer:
    assert big_server_proc is not None, f"big_server_proc launches only for {BIG_TESTS}"
    start = time.monotonic()
    big_server_proc.wait_healthy(900.0)
    print(f"\n25M vLLM server healthy (waited {time.monotonic() - start:.1f}s here)")
    return VLLMTestServer(big_server_proc, big_model_dir(), time.monotonic() - start)


# ------------------------------------------------------------------- 1. logprobs


@pytest.mark.slow
def test_trainer_recomputes_server_logprobs(vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path) -> None:
    """Token-in/token-out: vLLM's processed logprobs == FSDPEngine.forward logprobs at T."""
    run_worker("logprobs", tiny_model_dir, vllm_server, tmp_path, "--temperatures", "1.0", "0.7")
    result = torch.load(tmp_path / "logprobs.pt")
    assert sorted(result) == [0.7, 1.0]
    for temp, r in result.items():
        server, trainer = torch.tensor(r["server"]), torch.tensor(r["trainer"])
        assert len(server) == 2 * 4 * 48  # 2 ranks x 4 samples x 48 tokens
        diff = (server - trainer).abs()
        print(f"T={temp}: mean |server - trainer| {diff.mean():.4f}, max {diff.max():.4f}")
        assert diff.mean() < LOGPROB_TOL, f"T={temp}: mean logprob diff {diff.mean():.4f}"
        # The default trainer computes in bf16 over fp32 weights, as the bf16 server does (docs/precision.md).
        bf16 = (server - torch.tensor(r["trainer_bf16"])).abs()
        print(f"T={temp}: mean |server - bf16 trainer| {bf16.mean():.4f}, max {bf16.max():.4f}")
        assert bf16.mean() < LOGPROB_TOL, f"T={temp}: mean logprob diff, bf16 trainer {bf16.mean():.4f}"
        if temp != 1.0:  # the temperature matters: logprobs of the raw logits are clearly off
            raw = (server - torch.tensor(r["trainer_raw"])).abs().mean()
            print(f"T={temp}: mean |server - trainer at T=1| {raw:.4f}")
            assert raw > 2 * LOGPROB_TOL


# ---------------------------------------------------------------- 2. weight updates


def _update_session_server(
    server: VLLMTestServer, model: str, tmp_path: Path, sync: str, seed: int, extra: list[str]
) -> None:
    """Train a step, push the weights to the session server by ``sync``, check greedy output, restore."""
    label = weight_label(server)
    # Many candidates: on the bf16 server only the widest-gap ones are compared.
    prompts = random_prompts(int(load_hf(model).config.vocab_size), seed=seed, n=256)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    try:
        run_worker(
            "update", model, server, tmp_path, "--sync", sync, *extra,
            "--prompts", str(tmp_path / "prompts.json"), "--lr", "1e-3",
        )  # fmt: skip
        check_update_record(tmp_path, prompts, sync, fp32_server=False)
    finally:
        restore_session_server(server, label)


@pytest.mark.slow
def test_disk_update_from_fsdp_engine(vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path) -> None:
    _update_session_server(vllm_server, tiny_model_dir, tmp_path, "disk", seed=11, extra=[])


@pytest.mark.slow
def test_collective_update_from_megatron_tensor_parallel(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    """MegatronEngine at TP=2: full HF-named tensors gathered from its TP shards reach the server."""
    _update_session_server(
        vllm_server, tiny_model_dir, tmp_path, "collective", seed=13, extra=["--allocation", "megatron:t2"]
    )


@pytest.mark.slow
def test_truncated_sampling_ratios_are_unbiased_with_the_replay(big_server: VLLMTestServer, tmp_path: Path) -> None:
    """At top_p=0.8, top_k=20, T=1 the server's (processed) logprobs are of the truncated distribution:
    PPOActor.compute_logp with truncation_replay matches them, the full-vocabulary logprobs are biased low.

    On the fp32 25M server (before any test updates it), so trainer and sampler logits agree to fp32
    rounding and the kept sets match; on the bf16 session server near-boundary tokens flip in and out.
    """
    run_worker("truncated", big_server.model_dir, big_server, tmp_path, "--top-p", "0.8", "--top-k", "20")
    r = {k: torch.tensor(v) for k, v in torch.load(tmp_path / "truncated.pt").items()}
    assert len(r["server"]) == 2 * 4 * 48  # 2 ranks x 4 samples x 48 tokens
    gap = r["replay"] - r["server"]
    ratio, full_ratio = gap.exp(), (r["full"] - r["server"]).exp()
    outside = r["outside"].mean()
    print(
        f"replay: mean |gap| {gap.abs().mean():.2e}, max {gap.abs().max():.2e}, mean ratio {ratio.mean():.6f}, "
        f"outside {outside:.4f}; full vocabulary: mean ratio {full_ratio.mean():.4f}, max {full_ratio.max():.4f}"
    )
    assert gap.abs().mean() < TRUNCATED_TOL, f"replay: mean |trainer - server| {gap.abs().mean():.2e}"
    assert abs(ratio.mean() - 1) < TRUNCATED_TOL, f"replay: mean ratio {ratio.mean():.6f}"
    assert outside <= TRUNCATED_OUTSIDE, f"{outside:.4f} of the tokens fell outside the trainer's kept set"
    # Without the replay every token's full-vocabulary logprob is lower (by log of the kept mass).
    assert bool((r["full"] < r["server"]).all()), "a full-vocabulary logprob is not below the server's"
    assert full_ratio.mean() < FULL_VOCAB_MAX_RATIO, f"full vocabulary: mean ratio {full_ratio.mean():.4f}"


@pytest.mark.slow
def test_collective_update_25m_model_in_buckets(big_server: VLLMTestServer, tmp_path: Path) -> None:
    model = big_server.model_dir
    hf = load_hf(model)
    n_params = sum(p.numel() for p in hf.parameters())
    assert 20e6 < n_params < 30e6, n_params
    prompts = random_prompts(int(hf.config.vocab_size), seed=12, n=64)
    del hf
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    run_worker(
        "update",
        model,
        big_server,
        tmp_path,
        "--sync",
        "collective",
        "--bucket-mb",
        "8",
        "--prompts",
        str(tmp_path / "prompts.json"),
        "--lr",
        "2e-4",
    )
    record = check_update_record(tmp_path, prompts, "collective", fp32_server=True)
    sizes = record["bucket_sizes"]
    print(f"collective: {n_params / 1e6:.1f}M fp32 parameters in {len(sizes)} buckets of {sizes} tensors")
    assert len(sizes) > 1 and sum(sizes) == record["n_params"]
    assert record["recv_rpcs"] == 1  # all buckets' specs in one RPC; the trainer streamed the broadcasts


@pytest.mark.slow
def test_failed_update_is_clear_and_server_stays_updatable(vllm_server: VLLMTestServer, tiny_model_dir: str) -> None:
    """A weight name the model lacks fails the receive RPC with that name, and a later update still works."""
    server, b = vllm_server, vllm_server.backend
    label = weight_label(server)
    port = free_port()
    meta = WeightUpdateMeta(type="collective", group_port=port, world_size=2, comm_backend="gloo")
    original = load_hf(tiny_model_dir)
    ref = decisive_prompt(original, 12, seed=0)
    # Several buckets in ONE receive RPC, an early MLP weight renamed: the server rejects it, still takes
    # every later broadcast (so the trainer is not left blocked), then fails the RPC naming the weight.
    state = {k.replace("layers.1.mlp.up_proj", "layers.1.mlp.bogus"): v for k, v in original.state_dict().items()}
    buckets = list(split_buckets(state.items(), bucket_bytes=150_000))
    assert len(buckets) >= 3 and not any("bogus" in name for name, _ in buckets[-1])
    th, box = server.call_in_thread(b.build_init_weight_group(meta, rank_offset=1))
    pg = host_group(meta.group_addr, port, meta.world_size, meta.comm_backend, timeout_s=120)
    try:
        join(th, box)
        server.call(b.build_pause())
        th, box = server.call_in_thread(b.build_update_from_collective(meta, [pack_bucket(bk)[1] for bk in buckets]))
        broadcast_buckets(pg, buckets)
        with pytest.raises(RuntimeError, match="HTTP 500.*layers.1.mlp.bogus"):
            join(th, box)
        restore_session_server(server, label)  # failed here before vllm_ext finalized failed reloads
        assert_greedy_matches(server.generate(ref.prompt, 12), ref)
    finally:
        server.call(HttpRequest("POST", "/collective_rpc", {"method": "tandemrl_destroy_weight_group"}, 60.0))
        destroy_group(pg)
        restore_session_server(server, label)


@pytest.mark.slow
def test_failed_receive_request_does_not_strand_the_trainer(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    """The receive request fails on the client after the trainer posted its broadcasts (the server never
    saw it): the push fails with that request's one line instead of blocking until the weight group's
    timeout (600 s, longer than this worker may run), the server is left unpaused with its weights and
    label, leaves the group when asked, and the next update joins a new group and lands."""
    label = weight_label(vllm_server)
    args = ["leave", "--model", tiny_model_dir, "--addr", vllm_server.proc.address, "--out", str(tmp_path)]
    try:
        run_torchrun(WORKER, nproc=1, args=args, env=WORKER_ENV, timeout=400)
    finally:
        restore_session_server(vllm_server, label)
    r = torch.load(tmp_path / "leave.pt")
    assert "/collective_rpc failed: ServerDisconnectedError" in r["error"], r.get("error")
    assert r["label_failed"] == r["label_before"] and len(r["generates_after_failure"]) == 4
    methods = ["tandemrl_init_weight_group", "tandemrl_destroy_weight_group", "tandemrl_init_weight_group"]
    assert r["rpcs"] == [*methods, "tandemrl_recv_weights"], r["rpcs"]
    assert r["label_after"] == "1" and r["versions"] == (1, 1), (r["label_after"], r["versions"])


# ------------------------------------------------------------------ 3. interruption


def perturbed_dir(model_dir: str, out: Path) -> torch.nn.Module:
    """A strongly different model of the same scale: noise on every weight, lm_head x2.

    (A much larger logit scale would also scale the bf16 rounding of the server's logprobs.)
    """
    model = load_hf(model_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        model.lm_head.weight.mul_(2.0)
    model.save_pretrained(out)
    return model


@torch.no_grad()
def output_logprobs(model: torch.nn.Module, resp: ModelResponse) -> torch.Tensor:
    """fp32 logprobs (T=1) of each output token given everything before it."""
    seq = torch.tensor([resp.input_tokens + resp.output_tokens])
    logp = torch.log_softmax(model(seq, use_cache=False).logits[0].float(), -1)
    p = resp.input_len
    return logp[p - 1 : -1].gather(1, seq[0, p:, None])[:, 0]


class ReplyRecorder(HttpClient):
    """The real HTTP client, recording each generate call's request id and reply (tokens, finish reason)."""

    def __init__(self) -> None:
        super().__init__("switch-test")
        self.sent: list[str] = []
        self.replies: list[tuple[str, int, str]] = []

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        is_generate = req.path == "/inference/v1/generate" and req.json is not None
        if is_generate:
            self.sent.append(req.json["request_id"])
        payload = await super().send(addr, req, *args, **kwargs)
        if is_generate:
            choice = payload["choices"][0]
            self.replies.append((req.json["request_id"], len(choice["token_ids"]), choice["finish_reason"]))
        return payload

    def of(self, rid: str) -> list[tuple[str, int, str]]:
        return [r for r in list(self.replies) if r[0] == rid]

    def in_flight(self, rid: str) -> bool:
        return list(self.sent).count(rid) > len(self.of(rid))


@pytest.mark.slow
def test_interrupted_generation_switches_version(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    """pause -> disk update + version -> resume mid-generation: old tokens by old weights, new by new."""
    label = weight_label(vllm_server)
    old, new = load_hf(tiny_model_dir), perturbed_dir(tiny_model_dir, tmp_path / "v1")
    n, min_side = 64, 20  # tokens in all; at least this many per version
    prompt = [5, 17, 42, 99, 100, 7, 301, 12]
    client = ReplyRecorder()
    engine = RemoteInferenceClient.for_backend(
        "vllm", InferenceClientConfig(request_retries=1, setup_timeout=60.0), http_client=client
    )
    engine.initialize([vllm_server.proc.address])

    async def switch_midway(req: ModelRequest) -> ModelResponse:
        """The server's test hook holds the request between tokens (tests/vllm_gate.py): let it decode
        ``min_side`` tokens, pause (the call returns its partial output), update the weights and the
        version, resume. No timing: the pause always lands after exactly the tokens granted."""
        with vllm_server.gate(prompt) as gate:
            task = asyncio.ensure_future(engine.agenerate(req))
            held = await asyncio.to_thread(gate.wait_held)
            held = await asyncio.to_thread(gate.advance, held, min_side)
            await asyncio.to_thread(gate.release_until, engine.pause_generation, held, n - min_side)
        start = time.perf_counter()
        meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)
        await asyncio.to_thread(lambda: engine.update_weights_from_disk(meta).result())
        await asyncio.to_thread(engine.continue_generation)
        print(f"\ndisk update + version + resume while paused: {time.perf_counter() - start:.2f}s")
        return await task

    try:
        req = ModelRequest(rid="switch", input_ids=list(prompt))
        req.metadata["ignore_eos"] = True
        req.gconfig = req.gconfig.new(temperature=1.0, max_new_tokens=n)
        resp = asyncio.run(switch_midway(req))
        assert resp.output_len == n and resp.stop_reason == "length"
        assert len(resp.output_logprobs) == n
        versions = resp.output_versions
        k = versions.index(1) if 1 in versions else n
        assert versions == [0] * k + [1] * (n - k), f"versions must be old then new, monotone: {versions}"
        assert min_side <= k <= n - min_side, k
        # Interrupted and resubmitted: the first new-version token came from a later call.
        assert [r[2] for r in client.of(req.rid)] == ["abort", "length"]
        server = torch.tensor(resp.output_logprobs)
        lp_old, lp_new = output_logprobs(old, resp), output_logprobs(new, resp)
        diffs = {
            "before/old": (server[:k] - lp_old[:k]).abs().mean(),
            "before/new": (server[:k] - lp_new[:k]).abs().mean(),
            "after/new": (server[k:] - lp_new[k:]).abs().mean(),
            "after/old": (server[k:] - lp_old[k:]).abs().mean(),
        }
        print(
            f"switch after {k}/{n} tokens; mean |logprob diff| " + ", ".join(f"{a} {v:.4f}" for a, v in diffs.items())
        )
        assert diffs["before/old"] < LOGPROB_TOL and diffs["after/new"] < LOGPROB_TOL
        assert diffs["before/new"] > 5 * LOGPROB_TOL and diffs["after/old"] > 5 * LOGPROB_TOL
    finally:
        engine.destroy()
        client.close()
        restore_session_server(vllm_server, label)


# ------------------------------------------------------------------ 4. killed server


class RecordingClient(HttpClient):
    """The real HTTP client, recording (server, request id) of every generate call."""

    def __init__(self) -> None:
        super().__init__("kill-test")
        self.generate_calls: list[tuple[str, str]] = []

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        if req.path == "/inference/v1/generate" and req.json is not None:
            self.generate_calls.append((addr, req.json["request_id"]))
        return await super().send(addr, req, *args, **kwargs)

    def rids_on(self, addr: str) -> set[str]:
        return {rid for a, rid in list(self.generate_calls) if a == addr}


KILL_PROMPT = [17, 42, 99, 100, 7]  # every request of the kill test starts with it (the gate's key)


class NumberedWorkflow(RolloutWorkflow):
    """One sampled completion of a row-specific prompt; the row id travels with the trajectory."""

    def __init__(self, new_tokens: int) -> None:
        self.new_tokens = new_tokens

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict:
        i = int(data["id"])
        req = ModelRequest(rid=f"kill-{i}", input_ids=[*KILL_PROMPT, 3 + i], metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(max_new_tokens=self.new_tokens)
        resp = await engine.agenerate(req)
        ids = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
            "row_id": torch.tensor([i]),
            "n_out": torch.tensor([resp.output_len]),
        }


@pytest.mark.slow
def test_killed_server_mid_rollout_fails_over(vllm_server: VLLMTestServer, big_server: VLLMTestServer) -> None:
    """SIGKILL the 25M server while rollouts run on both servers; the session server survives.

    A failed-over request restarts on the survivor (the tiny model, same tokenizer and
    vocabulary): what is checked is the protocol (lengths, every rollout exactly once).
    """
    assert load_hf(big_server.model_dir).config.vocab_size == load_hf(vllm_server.model_dir).config.vocab_size
    rows, new_tokens = 8, 300
    dead, survivor = big_server.proc.address, vllm_server.proc.address
    base = {"request_retries": 2, "request_backoff": 0.2, "request_timeout": 30.0, "setup_timeout": 60.0}
    client = RecordingClient()
    both = RemoteInferenceClient.for_backend(
        "vllm", InferenceClientConfig(**base, max_concurrent_rollouts=rows), http_client=client
    )
    both.initialize([dead, survivor])  # round-robin: rows alternate between the servers
    only = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(**base))
    only.initialize([dead])
    executor = WorkflowExecutor(both.config, both, consumer_batch_size=rows)
    executor.initialize()

    def lonely() -> BaseException | None:
        req = ModelRequest(rid="lonely", input_ids=[*KILL_PROMPT, 9], metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(max_new_tokens=900)
        try:
            asyncio.run(only.agenerate(req))
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            return e
        return None

    pool = concurrent.futures.ThreadPoolExecutor(2)
    gate = big_server.gate(KILL_PROMPT)  # the 25M server decodes one token of each, then waits on the test
    try:
        batch_f = pool.submit(
            executor.rollout_batch, [{"id": i} for i in range(rows)], NumberedWorkflow(new_tokens), None, 300
        )
        lonely_f = pool.submit(lonely)
        deadline = time.monotonic() + 60
        while len(client.rids_on(dead)) < rows // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sent_to_dead = client.rids_on(dead)
        assert len(sent_to_dead) == rows // 2, sent_to_dead
        held = gate.wait_held()  # decoding on the dead server, and none of its requests can finish now
        assert not batch_f.done() and not lonely_f.done()
        killed_at = time.monotonic()
        os.killpg(big_server.proc.proc.pid, signal.SIGKILL)
        held.close()
        gate.disarm()

        batch = batch_f.result(timeout=300)
        print(f"\nbatch done {time.monotonic() - killed_at:.1f}s after the kill")
        err = lonely_f.result(timeout=120)
        marked_dead = both.pool.dead()
    finally:
        gate.disarm()
        pool.shutdown(wait=False, cancel_futures=True)
        executor.destroy()
        both.destroy()
        only.destroy()
        client.close()
        big_server.proc.stop()

    # Every rollout exactly once, at full length.
    assert sorted(batch["row_id"].tolist()) == list(range(rows))
    assert batch["n_out"].tolist() == [new_tokens] * rows
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths == [6 + new_tokens] * rows
    # The dead server's rollouts were resubmitted to the survivor; it is marked dead.
    assert sent_to_dead <= client.rids_on(survivor), (sent_to_dead, client.rids_on(survivor))
    assert list(marked_dead) == [dead], marked_dead

    # No survivor: a clear one-line error, caused by the dead connections, not the request timeout.
    assert isinstance(err, ServerUnavailableError), repr(err)
    msg = str(err)
    print(f"no survivor: {msg}")
    assert "\n" not in msg and "all 1 inference servers are marked dead" in msg and dead in msg, msg
    assert "no reply within" not in msg, msg
    # The session server is untouched.
    assert vllm_server.generate([11, 12, 13], 4).stop_reason == "length"


# ------------------------------------------------------------------- 5. delta sync


@pytest.mark.slow
def test_delta_updates_leave_server_bit_identical(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    """5 delta updates (xor in fp32, then sparse cast to bf16; an anchor every 3) after real optimizer steps:
    the server's copy is the trainer's (cast) export bit for bit, and its model serves exactly what a whole
    fp32 update of the same weights serves (so the trainer's cast equals the server's own). A second whole
    update reuses rank 0's pack buffers and serves what a disk update of the same weights serves."""
    label = weight_label(vllm_server)
    try:
        run_worker("delta", tiny_model_dir, vllm_server, tmp_path, "--lr", "1e-5")
    finally:
        restore_session_server(vllm_server, label)
    r = torch.load(tmp_path / "delta.pt")
    for kind, sent, full, changed, elements in r["updates"]:
        frac = f"{changed / elements:.3f}" if elements else "-"
        print(f"{kind}: {sent} of {full} bytes, changed fraction {frac}")
    updates = r["updates"]
    anchors = [i for i, u in enumerate(updates) if u[4] == 0]  # nothing compared: sent whole
    assert anchors == [0, 3], anchors
    assert all(u[1] < u[2] for i, u in enumerate(updates) if i not in anchors), "a delta moved no fewer bytes"
    assert all(0 < u[3] <= u[4] for i, u in enumerate(updates) if i not in anchors)
    server = r["server"]
    assert server["tag"] is not None and server["tensors"] == r["trainer"]  # sha256 per tensor
    assert r["after_delta"] == r["after_full"]  # logprobs, exactly
    assert r["after_delta"] != r["original"]
    assert r["server_after_full"]["tag"] is None  # a whole update drops the delta copy
    # A second whole update lands in the first one's buffers (rank 0 packs into the same memory) and serves
    # exactly what a disk update of the same weights serves.
    before, after = r["pack_buffers"]
    assert before and before == after, r["pack_buffers"]
    assert r["after_whole2"] == r["after_disk"] and r["after_whole2"] != r["after_full"]
    stats = r["stats"]
    assert stats["weight_sync/bytes"] > 0 and 0 < stats["weight_sync/changed_fraction"] <= 1, stats
