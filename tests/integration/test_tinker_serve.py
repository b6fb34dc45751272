"""The unmodified ``tinker`` SDK against a real ``tandemrl tinker-serve`` and a real LoRA-enabled vLLM server
on the tiny model (docs/tinker.md). One vLLM server for the whole module, one LoRA tinker-serve process and one
``--full-weight`` tinker-serve process per backend on it; one more tinker-serve starts its own vLLM server to be
stopped during a training call."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import requests
import tinker
import torch
from tinker import types
from utils import REPO_ROOT, free_port
from vllm_server import LORA_MAX_ADAPTERS as MAX_ADAPTERS
from vllm_server import Vllm

from tandemrl.inference.server_auth import auth_headers
from tandemrl.inference.vllm import VLLMBackend

pytestmark = pytest.mark.slow
BF16_TOL = 0.1
# vLLM runs the tiny model in bf16 (the fixture's dtype), tinker-serve's trainer in fp32. The same adapter's logprobs
# from the two differed by at most 0.008 in four runs (36- and 300-token prompts, prompt and sampled logprobs; bf16
# keeps 8 significant bits, ~0.4% of a logit); 0.03 leaves that a margin and stays far below what a training round
# moves them (over 0.3 in the re-save test).
VLLM_TOL = 0.03
SERVED_NAME = "tiny:qwen2"  # the `served` fixture's --model-name: a name the SDK cannot load a tokenizer from
SESSION_TIMEOUT_S = 30  # the `served` fixture's --session-timeout (the SDK heartbeats every 10 s)


@dataclass
class Tinker:
    url: str
    key: str
    vllm_url: str
    base: str  # the served model's name (tinker-serve's --model)
    out: Path
    proc: subprocess.Popen[str]
    clients: list[tinker.ServiceClient] = field(default_factory=list)

    def client(self) -> tinker.ServiceClient:
        """A new SDK client; its session is finished before the server stops (else its heartbeat warns)."""
        self.clients.append(tinker.ServiceClient(base_url=self.url, api_key=self.key))
        return self.clients[-1]


@contextmanager
def _tinker_serve(model: str, vllm: Vllm | None, tmp: Path, *extra: str, name: str = "") -> Iterator[Tinker]:
    """A ``tandemrl tinker-serve`` process on ``vllm`` (None: it starts its own) serving ``model`` as ``name``
    (default: ``model``), ready once it wrote its key file."""
    port, key_file = free_port(), tmp / "key"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, "-m", "tandemrl.cli", "tinker-serve", "--model", model, "--port", str(port)]
    cmd += ["--vllm-addr", vllm.address] if vllm else ["--vllm-log", str(tmp / "vllm.log")]
    cmd += ["--key-file", str(key_file), "--out", str(tmp / "ckpt"), *extra]
    cmd += ["--model-name", name] if name else []
    log = open(tmp / "tinker.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    telemetry = os.environ.get("TINKER_TELEMETRY")
    try:
        while not key_file.exists() or not key_file.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"tinker-serve exited: {(tmp / 'tinker.log').read_text()[-3000:]}")
            time.sleep(0.5)
        os.environ["TINKER_TELEMETRY"] = "0"  # this process's SDK clients send none
        vllm_url = vllm.base_url if vllm else ""
        served = Tinker(f"http://127.0.0.1:{port}", key_file.read_text(), vllm_url, name or model, tmp / "ckpt", proc)
        try:
            yield served
        finally:
            if proc.poll() is None:  # a stopped server cannot finish sessions: its clients keep warning
                for client in served.clients:
                    client.close("success").result(timeout=60)
    finally:
        if telemetry is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = telemetry
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


@pytest.fixture(scope="module")
def served(tiny_model_dir: str, lora_vllm: Vllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tinker]:
    tmp = tmp_path_factory.mktemp("tinker")
    extra = ("--max-adapters", str(MAX_ADAPTERS), "--session-timeout", str(SESSION_TIMEOUT_S), "--serve", "adapter")
    lora_vllm.restore_base()
    with _tinker_serve(tiny_model_dir, lora_vllm, tmp, *extra, name=SERVED_NAME) as t:
        yield t


def test_sigterm_during_a_long_training_call_stops_tinker_serve_and_its_vllm_server(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """tinker-serve with the vLLM server it started: SIGTERM while a forward_backward on a big batch runs (its
    start line is in the log) ends the process with status 0 without that call finishing (no finish line); the
    vLLM server's processes are gone, and the running call's and the queued optim_step's futures fail in the SDK
    with 'tinker-serve is stopping'."""
    with _tinker_serve(tiny_model_dir, None, tmp_path) as served:
        children = psutil.Process(served.proc.pid).children(recursive=True)
        assert any("vllm" in " ".join(c.cmdline()) for c in children)
        tc = served.client().create_lora_training_client(base_model=served.base, rank=4).result()
        long = [_datum([5 + i % 900 for i in range(k, k + 513)], weights=[1.0] * 512) for k in range(600)]
        fb = tc.forward_backward(long, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        call = _wait_for_line(served, re.compile(r"call (\d+) \(forward_backward\) started"))
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(300) == 0
        log = (tmp_path / "tinker.log").read_text()
        assert f"call {call.group(1)} (forward_backward) started" in log
        assert f"call {call.group(1)} (forward_backward) done" not in log, log[-2000:]
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        for fut in (fb, opt):
            with pytest.raises(tinker.RequestFailedError, match="tinker-serve is stopping"):
                fut.result(timeout=120)


def _wait_for_line(served: Tinker, pattern: re.Pattern[str]) -> re.Match[str]:
    """The first match of ``pattern`` in tinker-serve's log, once it is written."""
    log = served.out.parent / "tinker.log"
    while not (match := pattern.search(log.read_text())):
        assert served.proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    return match


def _datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """Next-token datum: input ``tokens[:-1]``, targets ``tokens[1:]``, plus per-target ``inputs``."""
    loss_inputs = {"target_tokens": tokens[1:], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


def _logprobs(tc: tinker.TrainingClient, data: list[types.Datum]) -> list[list[float]]:
    out = tc.forward(data, "cross_entropy").result()
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


SEQ = [5, 17, 42, 99, 7, 23, 61, 88, 12, 30, 44, 71]


def test_supervised_steps_lower_the_loss_and_futures_resolve_in_submission_order(served: Tinker) -> None:
    """Two fwd/bwd + optim pairs submitted before any result is read: the second forward_backward saw the
    first optim_step (its loss is lower), and a third forward after them is lower still. A new client from a
    save_state checkpoint (with and without its optimizer) has the saved adapter, not the one of a further step."""
    tc = served.client().create_lora_training_client(base_model=served.base, rank=4).result()
    data = [_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))]
    adam = types.AdamParams(learning_rate=5e-3)
    futures = [tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)]
    futures += [tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)]
    first, second = futures[0].result(), futures[2].result()
    futures[3].result()
    after = -sum(_logprobs(tc, data)[0])
    assert second.metrics["loss:sum"] < first.metrics["loss:sum"]
    assert after < second.metrics["loss:sum"]

    saved = tc.save_state("sl-2").result().path
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    assert -sum(_logprobs(tc, data)[0]) < after  # a third step moved on from the checkpoint
    _unload(tc)
    restored = served.client().create_training_client_from_state(saved).result()
    assert -sum(_logprobs(restored, data)[0]) == pytest.approx(after, abs=1e-4)  # back to the checkpoint
    _unload(restored)
    resumed = served.client().create_training_client_from_state_with_optimizer(saved).result()
    assert -sum(_logprobs(resumed, data)[0]) == pytest.approx(after, abs=1e-4)
    _unload(resumed)


def test_two_lora_clients_train_independently_and_is_follows_the_advantage(served: Tinker) -> None:
    """importance_sampling with advantage +1 raises client A's logprobs, -1 lowers client B's; B's
    logprobs before its own step equal the untrained start, so A's update did not reach it."""
    sc = served.client()
    a = sc.create_lora_training_client(base_model=served.base, rank=4, seed=1).result()
    b = sc.create_lora_training_client(base_model=served.base, rank=4, seed=2).result()
    start = _logprobs(a, [_datum(SEQ)])[0]
    n = len(SEQ) - 1

    def step(tc: tinker.TrainingClient, adv: float) -> None:
        datum = _datum(SEQ, advantages=[adv] * n, logprobs=start)
        tc.forward_backward([datum], "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    step(a, 1.0)
    b_before = _logprobs(b, [_datum(SEQ)])[0]
    step(b, -1.0)
    a_after, b_after = _logprobs(a, [_datum(SEQ)])[0], _logprobs(b, [_datum(SEQ)])[0]
    assert b_before == pytest.approx(start, abs=1e-5)
    assert sum(a_after) > sum(start) + 0.1, (sum(start), sum(a_after))
    assert sum(b_after) < sum(start) - 0.1, (sum(start), sum(b_after))
    _unload(a)
    _unload(b)


def test_sampler_weights_are_the_updated_adapter_and_match_a_direct_vllm_call(served: Tinker) -> None:
    """After an RL step on sampled tokens, save_weights_for_sampler + sample returns the same greedy tokens and
    logprobs as vLLM called directly with that adapter directory; compute_logprobs of the sampled tokens rose."""
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=4, seed=3).result()
    prompt = types.ModelInput.from_ints(SEQ[:6])
    base = sc.create_sampling_client(base_model=served.base).result()
    seq = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result().sequences[0]
    full = SEQ[:6] + list(seq.tokens)
    n_prompt = 6 - 1  # targets that belong to the prompt
    adv = [0.0] * n_prompt + [1.0] * len(seq.tokens)
    old = [0.0] * n_prompt + list(seq.logprobs or [])
    for _ in range(2):
        tc.forward_backward([_datum(full, advantages=adv, logprobs=old)], "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = tc.save_weights_for_sampler("after-rl").result()
    assert saved.path.endswith("/sampler_weights/after-rl")
    sampler = sc.create_sampling_client(model_path=saved.path).result()
    new_lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    old_lp = base.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert sum(new_lp[6:]) > sum(old_lp[6:])  # type: ignore[arg-type]

    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    got = sampler.sample(prompt, 1, greedy).result().sequences[0]
    adapter_dir = served.out / saved.path.removeprefix("tinker://").split("/")[0] / "sampler_weights" / "after-rl"
    _post(served.vllm_url + "/v1/load_lora_adapter", {"lora_name": "direct-check", "lora_path": str(adapter_dir)})
    body = {
        "token_ids": SEQ[:6], "model": "direct-check",
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}, "stream": False,
    }  # fmt: skip
    direct = VLLMBackend().parse_generate(_post(served.vllm_url + "/inference/v1/generate", body))
    assert list(got.tokens) == direct.output_tokens
    assert list(got.logprobs or []) == pytest.approx(direct.output_logprobs, abs=1e-4)
    _unload(tc)


LONG = [5 + (37 * i) % 900 for i in range(300)]  # longer than vLLM's KV blocks: its prefix cache keeps some


def test_resaving_sampler_weights_under_one_name_serves_each_save(served: Tinker) -> None:
    """A loop that saves its sampler weights as "latest" after each training round: a sampling client made from the
    first save samples the second one after it. After each save the sampler's prompt logprobs, and the logprobs of a
    greedy sample from a 300-token prompt (whose KV the first round left in vLLM's prefix cache), equal the training
    client's own forward logprobs within VLLM_TOL; the second round moved the prompt logprobs by more than 10x that.
    The vLLM server then holds one load of the adapter (the replaced one is unloaded once no sample uses it)."""
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=4, seed=5).result()
    prompt, greedy = types.ModelInput.from_ints(LONG), types.SamplingParams(max_tokens=3, temperature=0.0)

    def train(tokens: list[int], lr: float, steps: int) -> None:
        for _ in range(steps):
            tc.forward_backward([_datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()

    def served_matches_trainer(sampler: tinker.SamplingClient) -> list[float]:
        prompt_lp = sampler.compute_logprobs(prompt).result()[1:]
        assert prompt_lp == pytest.approx(_logprobs(tc, [_datum(LONG)])[0], abs=VLLM_TOL)
        seq = sampler.sample(prompt, 1, greedy).result().sequences[0]
        own = _logprobs(tc, [_datum(LONG + list(seq.tokens))])[0][-len(seq.tokens) :]
        assert list(seq.logprobs or []) == pytest.approx(own, abs=VLLM_TOL), seq.tokens
        return prompt_lp  # type: ignore[return-value]

    train(LONG, 5e-3, 2)  # the adapter scale is 32/rank = 8 here
    path = tc.save_weights_for_sampler("latest").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    first = served_matches_trainer(sampler)
    train(LONG[::-1], 1.25e-2, 3)
    assert tc.save_weights_for_sampler("latest").result().path == path
    second = served_matches_trainer(sampler)
    assert max(abs(a - b) for a, b in zip(first, second, strict=True)) > 10 * VLLM_TOL

    def loads() -> list[str]:
        listed = requests.get(served.vllm_url + "/v1/models", headers=auth_headers(), timeout=60).json()["data"]
        return [m["id"] for m in listed if m["id"].startswith(f"{tc.model_id}--sampler_weights--latest")]

    deadline = time.monotonic() + 120
    while len(loads()) > 1 and time.monotonic() < deadline:  # the unload runs in the background
        time.sleep(0.2)
    assert len(loads()) == 1, loads()
    _unload(tc)


def test_stop_empty_samples_past_eos_up_to_max_tokens(served: Tinker) -> None:
    """An adapter trained to end SEQ with EOS: a greedy sample with the default stop is that EOS alone ("stop");
    with stop=[] (the SDK's "no stop, not even EOS") it runs to max_tokens: 6 tokens, the first that EOS ("length")."""
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=4, seed=6).result()
    eos = tc.get_tokenizer().eos_token_id
    datum = _datum([*SEQ, eos], weights=[0.0] * (len(SEQ) - 1) + [1.0])
    for _ in range(4):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SEQ)
    ends = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    assert (list(ends.tokens), ends.stop_reason) == ([eos], "stop")
    runs = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]
    assert (len(runs.tokens), runs.tokens[0], runs.stop_reason) == (6, eos, "length")
    _unload(tc)


def test_training_and_sampling_clients_load_the_model_tokenizer_under_an_unloadable_name(
    served: Tinker, tiny_model_dir: str
) -> None:
    """The fixture serves the model as 'tiny:qwen2', from which the SDK cannot load a tokenizer (it would ask the hub
    for 'tiny'). A training client's tokenizer, and those of sampling clients made from its saved weights
    (save_weights_and_get_sampling_client, create_sampling_client(model_path=...)), are the model's own."""
    from transformers import AutoTokenizer

    text = "Natalia sold clips to 48 of her friends in April."
    want = AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=2).result()
    path = tc.save_weights_for_sampler("tok").result().path
    samplers = [tc.save_weights_and_get_sampling_client().result(), sc.create_sampling_client(model_path=path).result()]
    assert tc.get_tokenizer().encode(text) == want
    assert [s.get_tokenizer().encode(text) for s in samplers] == [want, want]
    _unload(tc)


def test_topk_prompt_logprobs_are_vllms_most_likely_tokens(served: Tinker) -> None:
    """topk_prompt_logprobs=3: no row for the first prompt token, then at each position vLLM's 3 most likely tokens
    (vLLM called directly with prompt_logprobs 3) with their logprobs, by rank; the prompt's own logprobs come too."""
    sc = served.client()
    base = sc.create_sampling_client(base_model=served.base).result()
    prompt = SEQ[:8]
    out = base.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True, topk_prompt_logprobs=3,
    ).result()  # fmt: skip
    params = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 3, "detokenize": False}
    body = {"token_ids": prompt, "sampling_params": params, "stream": False}
    direct = _post(served.vllm_url + "/inference/v1/generate", body)
    rows = direct["prompt_logprobs"][1:]
    ranked = [sorted((e["rank"], int(t), e["logprob"]) for t, e in row.items() if e["rank"] <= 3) for row in rows]
    got = out.topk_prompt_logprobs
    assert got is not None and got[0] is None
    assert [[t for t, _ in row or []] for row in got[1:]] == [[t for _, t, _ in row] for row in ranked]
    assert [lp for row in got[1:] for _, lp in row or []] == pytest.approx([lp for r in ranked for _, _, lp in r])
    own = [row[str(t)]["logprob"] for row, t in zip(rows, prompt[1:], strict=True)]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[1:] == pytest.approx(own)


def test_closed_and_silent_sessions_free_their_training_clients(served: Tinker) -> None:
    """Five sessions in turn, more than the cap of live training clients, each creating a client and closing
    (ServiceClient as a context manager): every create succeeds, and a closed session's heartbeat is answered 410
    (the SDK stops heartbeating on it). A program that exits without closing (its heartbeats stop) loses its client
    once --session-timeout passes: the server logs that session's end, and the client is unknown after it."""
    ids = []
    for _ in range(5):
        with tinker.ServiceClient(base_url=served.url, api_key=served.key) as sc:
            ids.append(sc.create_lora_training_client(base_model=served.base, rank=2).result().model_id)
    assert len(set(ids)) == 5
    beat = _api(served, "session_heartbeat", {"session_id": ids[0].split(":train:")[0]})
    assert (beat.status_code, beat.text) == (
        410,
        f"session_id: session {ids[0].split(':train:')[0]!r} has finished (success)",
    )

    program = (
        "import os, tinker\n"
        f"sc = tinker.ServiceClient(base_url={served.url!r}, api_key={served.key!r})\n"
        f"print(sc.create_lora_training_client(base_model={served.base!r}, rank=2).result().model_id, flush=True)\n"
        "os._exit(0)\n"
    )
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    model_id = done.stdout.split()[-1]
    session = model_id.split(":train:")[0]
    _wait_for_line(served, re.compile(f"session {session} ended: no heartbeat for {SESSION_TIMEOUT_S}s"))
    assert _api(served, "get_info", {"model_id": model_id}).status_code == 404


def test_errors_are_the_sdks_typed_errors_with_one_line(served: Tinker) -> None:
    sc = served.client()
    with pytest.raises(tinker.NotFoundError, match="base_model: 'nope' is not served here"):
        sc.create_lora_training_client(base_model="nope", rank=4).result()
    with pytest.raises(tinker.NotFoundError, match="model_path: no saved weights 'tinker://nope:train:0/"):
        sc.create_sampling_client(model_path="tinker://nope:train:0/sampler_weights/x").result()
    gone = sc.create_lora_training_client(base_model=served.base, rank=4).result()
    _unload(gone)
    with pytest.raises(tinker.NotFoundError, match=f"model_id: unknown model '{gone.model_id}'") as err:
        gone.forward_backward([_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))], "cross_entropy").result()
    assert "\n" not in err.value.message
    tc = sc.create_lora_training_client(base_model=served.base, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn: unknown loss 'nope'"):
        tc.forward_backward([_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))], "nope").result()  # type: ignore[arg-type]
    with pytest.raises(
        tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.weights: shape \[3\], expected \[11\]"
    ):
        tc.forward_backward([_datum(SEQ, weights=[1.0] * 3)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs: missing 'advantages'"):
        tc.forward_backward([_datum(SEQ)], "ppo").result()
    _refuses_bad_input(served, sc, tc)
    others = [sc.create_lora_training_client(base_model=served.base, rank=2).result() for _ in range(MAX_ADAPTERS - 1)]
    with pytest.raises(tinker.BadRequestError, match="LoRA training clients are live, the cap"):
        sc.create_lora_training_client(base_model=served.base, rank=2).result()
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key: missing or not this server's key"):
        tinker.ServiceClient(base_url=served.url, api_key="tml-wrong").create_lora_training_client(
            base_model=served.base, rank=2
        ).result()
    for c in [tc, *others]:
        _unload(c)


def _refuses_bad_input(served: Tinker, sc: tinker.ServiceClient, tc: tinker.TrainingClient) -> None:
    """Token ids outside the tiny model's 1024, a datum longer than the vLLM server's context, a negative learning
    rate and sample fields tinker-serve does not serve are refused at submission; vLLM's own refusal (more prompt
    logprobs than it allows) fails the call without the vLLM server's address."""
    vocab = r"is outside the vocabulary \(0\.\.1023, 1024 ids\)"
    with pytest.raises(tinker.BadRequestError, match=rf"data\[0\]\.model_input: token id 1024 {vocab}"):
        tc.forward_backward([_datum([5, 1024, 7], weights=[1.0, 1.0])], "cross_entropy").result()
    bad_target = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, -1]})
    with pytest.raises(tinker.BadRequestError, match=rf"data\[0\]\.loss_fn_inputs\.target_tokens: token id -1 {vocab}"):
        tc.forward([bad_target], "cross_entropy").result()
    long = [5 + i % 900 for i in range(1026)]
    with pytest.raises(tinker.BadRequestError, match=r"data\[1\]\.model_input: 1025 tokens, longer than the sampler's "
                       r"context \(max_model_len 1024\)"):  # fmt: skip
        tc.forward([_datum(SEQ), _datum(long)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="learning_rate must be a finite number >= 0, got -0.001"):
        tc.optim_step(types.AdamParams(learning_rate=-1e-3)).result()
    base = sc.create_sampling_client(base_model=served.base).result()
    prompt, params = types.ModelInput.from_ints(SEQ), types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match=rf"prompt: token id 5000 {vocab}"):
        base.sample(types.ModelInput.from_ints([5, 5000]), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs: not supported by tinker-serve"):
        base.sample(prompt, 1, params, topk_sample_logprobs=2).result()
    with pytest.raises(tinker.RequestFailedError, match="vLLM /inference/v1/generate: HTTP 400 Bad Request: Requested "
                       "prompt logprobs of 30, which is greater than max allowed: 20") as err:  # fmt: skip
        base.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=30).result()
    assert served.vllm_url.removeprefix("http://") not in str(err.value)


def test_every_sdk_loss_is_served_with_its_hand_value_or_refused_in_one_line(served: Tinker) -> None:
    """Each loss the SDK 0.38 names, on one datum of a sequence sampled with ``record_stability_info`` (distinct
    sequence ids) and carrying its provenance: with sampler logprobs set to the client's own minus log 1.5 (ratio
    1.5 on the sampled tokens, advantage 1), every served loss's ``loss:sum`` is its hand value (gspo with its
    default and with wider clip thresholds); ``forward_backward_custom`` reports its loss and the server's
    cross_entropy with the loss's gradient as weights; stable_reinforce, loss_fn ``custom``, an unknown config key
    and Dimuon are the SDK's ``BadRequestError`` with one line."""
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=2).result()
    sampler = sc.create_sampling_client(base_model=served.base, record_stability_info=True).result()
    prompt = SEQ[:5]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    assert all(s.sequence_id for s in seqs) and seqs[0].sequence_id != seqs[1].sequence_id
    sid, sampled = seqs[0].sequence_id, list(seqs[0].tokens)
    full, n_p, n_s = prompt + sampled, len(prompt) - 1, len(sampled)
    all_lp = _logprobs(tc, [_datum(full)])[0]  # the client's logprobs; no optim_step follows, so they stay
    lp, prompt_sq = all_lp[n_p:], sum(x * x for x in all_lp[:n_p])
    delta = math.log(1.5)
    datum = _datum(full, advantages=[0.0] * n_p + [1.0] * n_s, logprobs=[0.0] * n_p + [x - delta for x in lp])
    datum = datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=n_s - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_p),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n_s)],
    )  # fmt: skip
    weighted = _datum(full, weights=[0.0] * n_p + [1.0] * n_s)
    cases: list[tuple[types.Datum, str, dict[str, float] | None, float]] = [
        (weighted, "cross_entropy", None, -sum(lp)),
        (datum, "importance_sampling", None, -1.5 * n_s),
        (datum, "ppo", None, -1.2 * n_s),
        (datum, "cispo", None, -1.2 * sum(lp)),
        # dro's penalty also counts the prompt positions, whose sampler logprob is 0
        (datum, "dro", None, -(sum(lp) - 0.05 / 2 * (n_s * delta**2 + prompt_sq))),
        (datum, "gspo", None, -1.2 * n_s),
        (datum, "gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, -1.5 * n_s),
    ]
    for d, loss_fn, config, expected in cases:
        got = tc.forward_backward([d], loss_fn, config).result().metrics["loss:sum"]  # type: ignore[arg-type]
        assert got == pytest.approx(expected, abs=1e-4), (loss_fn, config)

    def squared(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return sum((x**2).sum() for x in logprobs), {}  # type: ignore[return-value]

    custom = tc.forward_backward_custom([_datum(full)], squared).result().metrics
    assert custom["loss:sum"] == pytest.approx(sum(x * x for x in all_lp), abs=1e-4)
    # the server's cross_entropy with weights -d(loss)/d(logp) = -2 logp: sum of 2 logp^2
    assert custom["surrogate_loss:sum"] == pytest.approx(2 * sum(x * x for x in all_lp), abs=1e-4)

    refused = [
        (lambda: tc.forward_backward([datum], "stable_reinforce"), "'stable_reinforce' is not served by tinker-serve"),
        (lambda: tc.forward_backward([datum], "custom", {"loss_id": "l-1"}), "'custom' is not served by tinker-serve"),
        (lambda: tc.forward_backward([datum], "ppo", {"clip_eps": 0.2}), "unknown key 'clip_eps' for loss 'ppo'"),
        (lambda: tc.optim_step(types.DimuonParams(learning_rate=1e-3)), "optimizer 'dimuon' is not served"),
        (
            lambda: sc.create_lora_training_client(
                base_model=served.base, rank=2, optimizer=types.DimuonOptimizerConfig()
            ),
            "optimizer_config: optimizer 'dimuon' is not served",
        ),
    ]
    for call, message in refused:
        with pytest.raises(tinker.BadRequestError, match=message) as err:
            call().result()
        assert "\n" not in err.value.message
    _unload(tc)


def test_rest_client_lists_training_runs_and_their_checkpoints(served: Tinker) -> None:
    """RestClient: the training run (LoRA, its rank, its metadata) and its two checkpoints with their types and
    tinker:// paths; an unknown run is the SDK's NotFoundError."""
    sc = served.client()
    tc = sc.create_lora_training_client(base_model=served.base, rank=2, user_metadata={"who": "listing"}).result()
    state = tc.save_state("st").result().path
    sampler = tc.save_weights_for_sampler("sw").result().path
    rest = tinker.RestClient(base_url=served.url, api_key=served.key)
    runs = rest.list_training_runs(limit=100).result()
    mine = [r for r in runs.training_runs if r.training_run_id == tc.model_id]
    assert len(mine) == 1 and mine[0].is_lora and mine[0].lora_rank == 2
    assert mine[0].user_metadata == {"who": "listing"} and mine[0].base_model == served.base
    assert runs.cursor.total_count >= 1
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/st", "training", state),
        ("sampler_weights/sw", "sampler", sampler),
    ]
    assert all((c.size_bytes or 0) > 0 for c in listed)
    with pytest.raises(tinker.NotFoundError, match="training_run_id: unknown training run 'nope'"):
        rest.get_training_run("nope").result()
    _unload(tc)


# ---------------------------------------------------------------------------------------------- helpers


def _unload(tc: tinker.TrainingClient) -> None:
    r = requests.post(
        tc.holder._base_url + "/api/v1/unload_model",
        json={"model_id": tc.model_id},
        headers={"X-API-Key": tc.holder._api_key or ""},
        timeout=60,
    )
    r.raise_for_status()


def _api(served: Tinker, route: str, body: dict) -> requests.Response:
    """POST ``body`` to tinker-serve's ``/api/v1/<route>`` with its key."""
    return requests.post(f"{served.url}/api/v1/{route}", json=body, headers={"X-API-Key": served.key}, timeout=60)


def _post(url: str, body: dict) -> dict:
    r = requests.post(url, json=body, headers=auth_headers(), timeout=120)
    if not r.ok:
        raise RuntimeError(f"{url} -> HTTP {r.status_code}: {r.text[:300]}")
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}


def test_example_rl_loop_runs_three_iterations_through_the_sdk(served: Tinker, gsm8k_dir: str) -> None:
    """examples/tinker_rl_loop.py (tinker SDK only) runs 3 GRPO-style iterations on the tiny model with
    ``--fill 1`` and ``--ratio-base trainer`` (a forward before each step): one JSON line per iteration with every sample scored; each iteration trains on exactly one
    group with signal, drawing 2 questions at a time, or trains nothing after its 4 draws; at least one
    trained; then a held-out line (greedy before/after on 4 test questions, with McNemar's p)."""
    env = {**os.environ, "TINKER_BASE_URL": served.url, "TINKER_API_KEY": served.key, "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "tinker_rl_loop.py"), "--base-model", served.base]
    cmd += ["--data", gsm8k_dir, "--iterations", "3", "--questions", "2", "--group", "4", "--max-tokens", "24"]
    cmd += ["--rank", "4", "--number-bonus", "0.1", "--lr", "1e-3", "--fill", "1", "--max-rounds", "3"]
    cmd += ["--temperature", "0.6", "--ratio-base", "trainer"]  # the SmolLM2 run's settings (docs/tinker.md)
    proc = subprocess.run([*cmd, "--eval", "4"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *lines, held_out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["iteration"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert line["questions"] in (2, 4, 6, 8) and line["samples"] == 4 * line["questions"], line
        assert 0.0 <= line["reward_mean"] <= 1.0, line
        assert line["trained_datums"] == 4 or (line["trained_datums"] == 0 and line["questions"] == 8), line
    trained = [line for line in lines if line["trained_datums"] > 0]
    assert trained and all(math.isfinite(line["loss"]) for line in trained), lines
    assert held_out["eval_n"] == 4 and held_out["gained"] + held_out["lost"] <= 4, held_out
    assert 0.0 <= held_out["accuracy_before"] <= 1.0 and 0.0 < held_out["mcnemar_p"] <= 1.0, held_out


def _hf_logprobs(model_dir: str, tokens: list[int]) -> list[float]:
    """Logprob of each of ``tokens[1:]`` under the HF model in ``model_dir`` (transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def _tensor_of(model_dir: str | Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
                return f.get_tensor(name).float()
    raise KeyError(f"{name} not in {model_dir}")


def test_merged_serving_samples_each_save_of_an_adapter_as_merged_weights(
    tiny_model_dir: str, lora_vllm: Vllm, tmp_path: Path
) -> None:
    """``--serve merged`` (what ``auto`` picks on CPU): a LoRA client's sampler weights reach vLLM as the base merged
    with the adapter. After each save of "latest" the sampler's prompt logprobs equal the training client's forward
    within BF16_TOL (vLLM computes in bf16) and the second save moved them by more than 3x that; a base-model sampler
    then gives the base model's logprobs again (transformers on the base directory)."""
    with _tinker_serve(tiny_model_dir, lora_vllm, tmp_path, "--serve", "merged") as served:
        sc = served.client()
        tc = sc.create_lora_training_client(base_model=served.base, rank=4, seed=3).result()
        data, prompt = [_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))], types.ModelInput.from_ints(SEQ)
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        first = _logprobs(tc, data)[0]
        path = tc.save_weights_for_sampler("latest").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(first, abs=BF16_TOL)
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        second = _logprobs(tc, data)[0]
        assert max(abs(a - b) for a, b in zip(first, second, strict=True)) > 3 * BF16_TOL
        assert tc.save_weights_for_sampler("latest").result().path == path
        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(second, abs=BF16_TOL)
        base = sc.create_sampling_client(base_model=served.base).result()
        base_ref = _hf_logprobs(tiny_model_dir, SEQ)
        assert base.compute_logprobs(prompt).result()[1:] == pytest.approx(base_ref, abs=BF16_TOL)
        _unload(tc)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed", "megatron"])
def test_full_weight_client_trains_every_weight_and_samples_its_saved_weights(
    tiny_model_dir: str, lora_vllm: Vllm, tmp_path: Path, backend: str
) -> None:
    """``--full-weight fsdp``, ``deepspeed`` and ``megatron``: cross_entropy steps on a repeated batch lower the
    loss; a step with learning rate 0 leaves the logprobs as they were (each step's Adam parameters are the ones
    used); the saved sampler weights differ from the base in a non-adapter tensor (the embeddings); sampling from
    them gives the logprobs of that saved model (transformers on the saved directory) and the base sampler the
    base model's again; a second live client is refused in one line. Saving again under the same name after another
    step, while the server holds the first save's weights: the first sampling client then gives the logprobs of that
    step (the training client's own forward)."""
    with _tinker_serve(tiny_model_dir, lora_vllm, tmp_path, "--full-weight", backend) as served:
        sc = served.client()
        tc = sc.create_lora_training_client(base_model=served.base, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="full-weight client .* is live and --full-weight trains one"):
            sc.create_lora_training_client(base_model=served.base, rank=4).result()
        data = [_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))]
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[2] < losses[1] < losses[0], losses
        trained = _logprobs(tc, data)[0]
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result()
        assert _logprobs(tc, data)[0] == trained

        saved = tc.save_weights_for_sampler("full-1").result()
        directory = served.out / tc.model_id / "sampler_weights" / "full-1"
        embed = "model.embed_tokens.weight"
        assert not torch.allclose(_tensor_of(directory, embed), _tensor_of(tiny_model_dir, embed))
        new_ref, base_ref = _hf_logprobs(str(directory), SEQ), _hf_logprobs(tiny_model_dir, SEQ)
        assert trained == pytest.approx(new_ref, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(new_ref, base_ref, strict=True)) > 0.5

        # The vLLM server computes in bf16: its logprobs sit within BF16_TOL of the fp32 reference.
        prompt = types.ModelInput.from_ints(SEQ)
        sampler = sc.create_sampling_client(model_path=saved.path).result()
        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(new_ref, abs=BF16_TOL)
        base = sc.create_sampling_client(base_model=served.base).result()  # loads the base weights back
        assert base.compute_logprobs(prompt).result()[1:] == pytest.approx(base_ref, abs=BF16_TOL)

        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(new_ref, abs=BF16_TOL)  # full-1 again
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        retrained = _logprobs(tc, data)[0]
        assert tc.save_weights_for_sampler("full-1").result().path == saved.path
        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(retrained, abs=BF16_TOL)
        assert max(abs(a - b) for a, b in zip(retrained, trained, strict=True)) > 3 * BF16_TOL
