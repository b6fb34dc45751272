"""The vLLM server side: the weight-update wire format, the server launcher, and (slow) one real
vLLM server (session fixture `vllm_server`, tiny model, bf16): token-in/token-out generation,
disk and collective weight updates, pause/abort/resume and version labels.

Every slow test leaves the server with the original weights and unpaused.
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from utils import free_port
from vllm_server import (
    VLLMTestServer,
    assert_greedy_matches,
    decisive_prompt,
    join,
    load_hf,
    perturbed_model,
    restore_original,
)

from tandemrl.api.inference import HttpRequest, ModelRequest, WeightUpdateMeta
from tandemrl.api.types import ParallelStrategy
from tandemrl.inference.server import ServerError, launch_server
from tandemrl.weights.group import destroy_group, host_group, join_group
from tandemrl.weights.wire import (
    broadcast_buckets,
    buckets_to_json,
    pack_bucket,
    parse_buckets_json,
    receive_buckets,
    split_buckets,
    unpack_bucket,
)

N = 12  # greedy tokens compared against transformers


# ------------------------------------------------------------------- wire format (fast)


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 5, generator=g).bfloat16(),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(7, generator=g).half(),
        "model.layers.0.mlp.up_proj.weight": torch.arange(5),
        "model.layers.1.input_layernorm.weight": torch.randn(3, generator=g),
        "model.norm.weight": torch.tensor(2.5),
        "lm_head.weight": torch.randn(2, 3, generator=g).t(),  # non-contiguous
    }


def test_pack_unpack_roundtrip_and_layer_aligned_buckets() -> None:
    state = _mixed_state()
    buckets = list(split_buckets(state.items(), bucket_bytes=100))
    # A decoder layer is never split across buckets, and nothing is lost or reordered.
    layer_of = {n: i for i, b in enumerate(buckets) for n, _ in b}
    assert len({layer_of[n] for n in state if n.startswith("model.layers.0.")}) == 1
    assert [n for b in buckets for n, _ in b] == list(state)
    assert len(buckets) >= 4
    for bucket in buckets:
        flat, specs = pack_bucket(bucket)
        assert flat.dtype == torch.uint8 and flat.dim() == 1
        for (name, got), (_, want) in zip(unpack_bucket(flat, specs), bucket, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), name
    specs = [pack_bucket(b)[1] for b in buckets]
    assert parse_buckets_json(buckets_to_json(specs)) == specs
    assert parse_buckets_json(buckets_to_json(specs[:1])[1:-1]) == specs[:1]  # one bare bucket


@pytest.mark.parametrize(
    ("meta_json", "needle"),
    [
        ("not json", "not valid JSON"),
        ("[]", "non-empty list"),
        ('[["w", "float32", [2, "x"]]]', "bucket 0 entry 0"),
        ('[["w", "floaty", [2]]]', "unknown torch dtype 'floaty'"),
    ],
)
def test_bad_bucket_meta_is_one_line_error(meta_json: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as e:
        parse_buckets_json(meta_json)
    assert "\n" not in str(e.value)


def test_unpack_rejects_wrong_size() -> None:
    flat, specs = pack_bucket([("w", torch.ones(4))])
    with pytest.raises(ValueError, match="describe"):
        unpack_bucket(flat[:-1], specs)


def test_weight_group_broadcasts_buckets_over_gloo() -> None:
    """Trainer rank 0 and a server rank (a thread here) rendezvous and move bucketed tensors."""
    state = _mixed_state()
    buckets = list(split_buckets(state.items(), bucket_bytes=100))
    meta_json = buckets_to_json([pack_bucket(b)[1] for b in buckets])
    port, got = free_port(), {}

    def server_rank() -> None:
        pg = join_group("127.0.0.1", port, 2, 1, "gloo", timeout_s=60)
        got.update(receive_buckets(pg, parse_buckets_json(meta_json), "cpu"))
        destroy_group(pg)

    th = threading.Thread(target=server_rank, daemon=True)
    th.start()
    pg = host_group("127.0.0.1", port, 2, "gloo", timeout_s=60)
    broadcast_buckets(pg, buckets)
    th.join(60)
    destroy_group(pg)
    assert set(got) == set(state)
    for name, want in state.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_join_rejects_rank_zero() -> None:
    with pytest.raises(ValueError, match="rank 0 must be in 1..1"):
        join_group("127.0.0.1", free_port(), 2, 0)


# ------------------------------------------------------------------------ launcher (fast)

_FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, signal
    mode = sys.argv[1]
    if mode == "crash":
        print("fake server: bad flag --oops", flush=True)
        sys.exit(3)
    # A child in the same process group that ignores SIGTERM: stop() must still kill it.
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer((sys.argv[2], int(sys.argv[3])), H).serve_forever()
    """
)


class _FakeBackend:
    """Just what launch_server needs from an InferenceBackend."""

    name = "fake"

    def __init__(self, script: Path, mode: str):
        self.script, self.mode = script, mode

    def server_command(self, model_path: str, host: str, port: int, strategy: Any, extra: dict[str, Any]) -> list[str]:
        return [sys.executable, str(self.script), self.mode, host, str(port)]

    def server_env(self) -> dict[str, str]:
        return {}

    def cpu_launch(self, flags: dict[str, Any], child_env: dict[str, str], env: dict[str, str], world: int) -> None:
        pass

    def build_health(self) -> HttpRequest:
        return HttpRequest("GET", "/health", None, 5.0)


def _running(pid: int) -> bool:
    """Alive and not a zombie (orphans may be reaped late by PID 1)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_launch_wait_healthy_and_stop_leaves_no_orphans(tmp_path: Path) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    log = tmp_path / "logs" / "fake.log"
    with launch_server(
        _FakeBackend(script, "serve"), str(tmp_path), strategy=ParallelStrategy(), log_file=str(log)
    ) as srv:
        assert srv.address == f"127.0.0.1:{srv.port}"
        srv.wait_healthy(timeout=60, poll_interval=0.2)
        pgid = srv.proc.pid
        deadline = time.monotonic() + 120  # generous: only a broken fake server gets near it
        while "child" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(log.read_text().split("child ")[1].split()[0])
        assert os.getpgid(child) == pgid
        srv.stop(grace=1.0)  # the child ignores SIGTERM and would sleep 600 s: only the SIGKILL after grace ends it
    assert not srv.is_running()
    assert not _running(child), "a child of the server survived stop() (SIGTERM-ignoring orphan)"


def test_wait_healthy_fails_fast_with_log_tail(tmp_path: Path) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    srv = launch_server(_FakeBackend(script, "crash"), str(tmp_path), log_file=str(tmp_path / "crash.log"))
    with pytest.raises(ServerError, match="exited with code 3") as e:  # the exit ended the wait, not the timeout
        srv.wait_healthy(timeout=120, poll_interval=0.2)
    assert "bad flag --oops" in str(e.value) and "not healthy after" not in str(e.value)
    srv.stop()


def test_launch_rejects_missing_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model_path"):
        launch_server(_FakeBackend(tmp_path / "x.py", "serve"), str(tmp_path / "nope"))


# ----------------------------------------------------------------- real vLLM server (slow)


@pytest.fixture(scope="module")
def hf_original(tiny_model_dir: str) -> torch.nn.Module:
    return load_hf(tiny_model_dir)


@pytest.mark.slow
def test_generate_matches_hf_greedy(vllm_server: VLLMTestServer, hf_original: torch.nn.Module) -> None:
    print(f"\nvLLM server start: {vllm_server.start_seconds:.1f}s")
    ref = decisive_prompt(hf_original, N, seed=0)
    chunk = vllm_server.generate(ref.prompt, N)
    assert chunk.stop_reason == "length"
    assert_greedy_matches(chunk, ref)
    # vLLM labels every token with the weight version that produced it.
    assert chunk.version_spans and chunk.version_spans[0].start == 0 and chunk.version_spans[-1].end == N


@pytest.mark.slow
def test_disk_update(vllm_server: VLLMTestServer, hf_original: torch.nn.Module, tmp_path: Path) -> None:
    server, b = vllm_server, vllm_server.backend
    new = perturbed_model(server.model_dir, seed=1, out_dir=tmp_path / "v1")
    ref_new = decisive_prompt(new, N, seed=1)
    before = server.generate(ref_new.prompt, N)
    assert before.output_tokens != ref_new.ids, "perturbed model should change the greedy output"
    try:
        start = time.perf_counter()
        server.call(b.build_pause())
        for req in b.build_update_from_disk(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"))):
            server.call(req)
        server.call(b.build_resume())
        print(f"\ndisk update (pause -> load -> flush -> resume): {time.perf_counter() - start:.3f}s")
        assert_greedy_matches(server.generate(ref_new.prompt, N), ref_new)
    finally:
        restore_original(server)
    assert server.generate(ref_new.prompt, N).output_tokens == before.output_tokens


@pytest.mark.slow
def test_collective_update_bucketed(vllm_server: VLLMTestServer, tiny_model_dir: str) -> None:
    server, b = vllm_server, vllm_server.backend
    port = free_port()
    meta = WeightUpdateMeta(
        type="collective", group_addr="127.0.0.1", group_port=port, world_size=2, comm_backend="gloo"
    )
    new = perturbed_model(tiny_model_dir, seed=2)
    ref_new = decisive_prompt(new, N, seed=2)
    before = server.generate(ref_new.prompt, N)
    assert before.output_tokens != ref_new.ids

    # The server's join blocks until rank 0 (this process, the "trainer") creates the group.
    th, box = server.call_in_thread(b.build_init_weight_group(meta, rank_offset=1))
    pg = host_group(meta.group_addr, port, meta.world_size, meta.comm_backend, timeout_s=120)
    assert join(th, box)["results"][0]["rank"] == 1
    try:
        # bf16 like a trainer would send; small buckets so several broadcasts happen.
        state = {k: v.to(torch.bfloat16) for k, v in new.state_dict().items()}
        buckets = list(split_buckets(state.items(), bucket_bytes=150_000))
        assert len(buckets) >= 3
        start = time.perf_counter()
        server.call(b.build_pause())
        for bucket in buckets:  # the extension also takes one bucket per RPC
            flat, specs = pack_bucket(bucket)
            th, box = server.call_in_thread(b.build_update_from_collective(meta, [specs]))
            pg.broadcast(flat, 0).wait()
            assert join(th, box)["results"][0]["tensors"] == len(bucket)
        server.call(b.build_flush_cache())
        server.call(b.build_resume())
        print(f"\ncollective update, {len(buckets)} RPCs: {time.perf_counter() - start:.3f}s")
        assert_greedy_matches(server.generate(ref_new.prompt, N), ref_new)

        # Back to the original weights in ONE RPC listing all buckets (the multi-bucket format).
        original = load_hf(tiny_model_dir).state_dict()
        buckets = list(split_buckets(original.items(), bucket_bytes=150_000))
        start = time.perf_counter()
        recv = b.build_update_from_collective(meta, [pack_bucket(bk)[1] for bk in buckets])  # the client's way
        th, box = server.call_in_thread(recv)
        broadcast_buckets(pg, buckets)
        assert join(th, box)["results"][0]["buckets"] == len(buckets)
        server.call(b.build_flush_cache())
        print(f"collective update, 1 RPC / {len(buckets)} buckets: {time.perf_counter() - start:.3f}s")
        assert server.generate(ref_new.prompt, N).output_tokens == before.output_tokens
    finally:
        server.call(HttpRequest("POST", "/collective_rpc", {"method": "tandemrl_destroy_weight_group"}, 60.0))
        destroy_group(pg)
        restore_original(server)


@pytest.mark.slow
def test_a_one_device_cpu_server_runs_its_model_in_the_engine_process(vllm_server: VLLMTestServer) -> None:
    """Two processes (API server, engine core), not three: a CPU start imports vLLM once less."""
    import psutil

    family = [psutil.Process(vllm_server.proc.proc.pid), *psutil.Process(vllm_server.proc.proc.pid).children(True)]
    cmds = {p: " ".join(p.cmdline()) for p in family}
    vllm = [p for p, cmd in cmds.items() if "vllm" in cmd.lower() and "lifeline" not in cmd]
    assert sorted(p.name() for p in vllm) == ["VLLM::EngineCore", "python"], cmds  # no VLLM::Worker


@pytest.mark.slow
def test_pause_abort_resume_and_version(vllm_server: VLLMTestServer) -> None:
    """A pause aborts a decoding request with its partial output; requests sent while paused wait.

    The server's test hook (tests/vllm_gate.py) holds the request before every token after its
    first until the test grants one, so the pause always lands mid-decode, however fast or
    loaded the machine is, and after exactly the tokens granted.
    """
    server, b = vllm_server, vllm_server.backend
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    budget = 64
    old_label = server.call(b.build_version_get())["weight_version"]
    req = ModelRequest(input_ids=prompt, metadata={"ignore_eos": True})
    try:
        with server.gate(prompt) as gate:
            th, box = server.call_in_thread(b.build_generate(req, [], budget, 0))
            held = gate.wait_held()  # decoding: >= 1 token out, the next one waits for the test
            first = gate.last_held
            gate.release_until(lambda: server.call(b.build_pause()), held, max_tokens=budget - 1)
            partial = b.parse_generate(join(th, box, timeout=60))
            assert partial.stop_reason == "abort"
            # Exactly the tokens the hook let through: the one it held at, plus one per grant.
            assert first >= 1 and len(partial.output_tokens) == gate.last_held + 1 < budget
            assert len(partial.output_logprobs) == len(partial.output_tokens)

            # While paused, a new request waits: it has reached the server (the hook saw it arrive),
            # the label changes, and only after resume is it served, all of it under the new label.
            body = b.build_generate(ModelRequest(input_ids=[9, 8, 7]), [], 8, 0)
            body.json["sampling_params"]["extra_args"] = {"tandemrl_witness": True}
            held_th, held_box = server.call_in_thread(body)
            gate.expect("arrived")[1].close()
        assert held_th.is_alive(), "a request sent while paused was served"
        server.call(b.build_set_version(7))
        assert b.parse_version(server.call(b.build_version_get())) == 7
        server.call(b.build_resume())
        held_out = b.parse_generate(join(held_th, held_box, timeout=60))
        assert held_out.stop_reason in ("length", "stop") and held_out.output_tokens
        assert held_out.token_versions(fallback=-1) == [7] * len(held_out.output_tokens)

        # Continue the aborted request from its partial output, as the client does.
        rest = b.parse_generate(server.call(b.build_generate(req, partial.output_tokens, 16, 0)))
        assert rest.stop_reason == "length" and len(rest.output_tokens) == 16
        assert rest.token_versions(fallback=-1) == [7] * 16
    finally:
        server.call(b.build_resume())
        server.call(HttpRequest("POST", "/update_weight_version", {"new_version": old_label}, 60.0))
    assert server.call(HttpRequest("GET", "/is_paused", None, 60.0))["is_paused"] is False


@pytest.mark.slow
def test_disk_update_from_missing_dir_fails_cleanly(vllm_server: VLLMTestServer, tmp_path: Path) -> None:
    b = vllm_server.backend
    steps = b.build_update_from_disk(WeightUpdateMeta(type="disk", path=str(tmp_path / "missing")))
    with pytest.raises(RuntimeError, match="HTTP 5"):
        vllm_server.call(steps[0])
    # The server survives the failed RPC and still serves.
    assert vllm_server.generate([11, 12, 13], 4).stop_reason == "length"


@pytest.mark.slow
def test_every_route_but_health_needs_the_run_token(vllm_server: VLLMTestServer) -> None:
    """vLLM's ``--api-key`` would leave the control and weight-update routes open; ours guards them:
    without the token (or with a wrong one) they answer 401 and do nothing; our client sends it."""
    import requests

    from tandemrl.inference.http import shared_client
    from tandemrl.inference.server_auth import TOKEN_ENV

    token = os.environ[TOKEN_ENV]
    b = vllm_server.backend
    rpc = b.build_update_from_disk(WeightUpdateMeta.from_disk("/nonexistent", "x", "y"))[0]
    routes = [b.build_pause(), b.build_resume(), b.build_set_version(7), b.build_flush_cache(), rpc]
    routes += [HttpRequest("GET", "/v1/models", None, 30.0), HttpRequest("POST", "/abort_requests", {}, 30.0)]
    gen = b.build_generate(ModelRequest(input_ids=[1, 2, 3]), [], 2, 0)
    routes.append(gen)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
        for req in routes:
            r = requests.request(req.method, vllm_server.url + req.path, json=req.json, headers=headers, timeout=30)
            assert r.status_code == 401, (req.path, headers.keys(), r.status_code, r.text[:200])
    assert requests.get(vllm_server.url + "/health", timeout=30).status_code == 200
    # The refused pause did nothing: generation still runs; our client (token from the env) gets through.
    assert vllm_server.generate([1, 2, 3], 2).output_tokens
    models = shared_client().send_sync(vllm_server.proc.address, routes[5])
    assert models["data"][0]["id"]
    # The token travels only through the environment: not on the command line, not in the log.
    assert token not in " ".join(vllm_server.proc.proc.args)
    assert token not in Path(vllm_server.proc.log_file).read_text(errors="replace")


@pytest.mark.slow
def test_warm_up_is_one_generate_request_and_never_raises(
    vllm_server: VLLMTestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The launcher's warm-up sends one generate request with the run token, which the server answers 200
    (its request log); with a wrong token the thread still ends, and the refusal is a logged warning."""
    import json

    from tandemrl.inference.server_auth import TOKEN_ENV

    assert vllm_server.request_log is not None
    log, offset = vllm_server.request_log, vllm_server.request_log.stat().st_size

    def logged() -> list[tuple[str, int]]:
        lines = log.read_bytes()[offset:].decode().splitlines()
        return [(r["path"], r["status"]) for r in map(json.loads, filter(None, lines))]

    thread = vllm_server.proc.warm_up(os.environ[TOKEN_ENV])
    thread.join(120)
    deadline = time.monotonic() + 30  # the log line is written as the response finishes
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not thread.is_alive() and logged() == [("/inference/v1/generate", 200)]
    with caplog.at_level("WARNING", logger="tandemrl.inference.server"):
        refused = vllm_server.proc.warm_up("wrong")
        refused.join(120)
    assert not refused.is_alive()
    assert any("warm-up request failed" in r.getMessage() and "401" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_vllm_port_taken_after_it_was_picked_is_one_line(tiny_model_dir: str, tmp_path: Path) -> None:
    """Another process binds the port between the pick and vLLM's bind: one line naming the port,
    well before the engine would have loaded (vLLM binds first)."""
    import socket

    from tandemrl.inference.server import PortInUseError
    from tandemrl.inference.vllm import VLLMBackend

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        server = launch_server(VLLMBackend(), tiny_model_dir, port=port, log_file=str(tmp_path / "vllm.log"))
        try:
            with pytest.raises(PortInUseError) as e:
                server.wait_healthy(timeout=600)
        finally:
            server.stop()
    assert str(e.value) == f"vllm server: port {port} on 127.0.0.1 is already in use (log {tmp_path / 'vllm.log'})"
