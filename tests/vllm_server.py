"""Helpers for tests against one real vLLM server: start it, talk to it, compute HF references.

The transport here is deliberately minimal (``requests``); the real client lives elsewhere.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
from utils import REPO_ROOT
from vllm_gate import GATE_ENV, Gate

from tandemrl.api.inference import GenerateChunk, HttpRequest, ModelRequest
from tandemrl.inference.server import ServerProcess, launch_server
from tandemrl.inference.server_auth import TOKEN_ENV, auth_headers, new_token
from tandemrl.inference.vllm import VLLMBackend

# The test server: bf16 like production, context small enough for a fast start; the test-only
# hooks of vllm_gate let a test hold a request between tokens (inactive unless a test arms it).
# Replies say how many prompt tokens the prefix cache served (``usage.prompt_tokens_details``).
VLLM_EXTRA: dict[str, Any] = {
    "max_model_len": 1024,
    "enable_prompt_tokens_details": True,
    "dtype": "bfloat16",
    "scheduler_cls": "vllm_gate.GateScheduler",
    "logits_processors": ["vllm_gate:ArrivalWitness"],
}
TESTS_DIR = Path(__file__).resolve().parent
START_TIMEOUT_S = 900.0


# The session's LoRA server (the ``lora_vllm`` fixture) holds this many adapters at once.
LORA_MAX_ADAPTERS = 3


@dataclass
class Vllm:
    """A running vLLM server's address (host:port) and base URL, started on ``model_dir``."""

    address: str
    base_url: str
    model_dir: str

    def restore_base(self) -> None:
        """The model's own weights again, unpaused: a merged or full-weight tinker-serve loads others as the base."""
        from tandemrl.api.inference import WeightUpdateMeta

        backend = VLLMBackend()
        steps = backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=self.model_dir))
        for req in [*steps, backend.build_resume()]:
            r = requests.request(
                req.method,
                self.base_url + req.path,
                json=req.json,
                timeout=req.timeout or 120.0,
                headers=auth_headers(),
            )
            if not r.ok:
                raise RuntimeError(f"{req.method} {req.path} -> HTTP {r.status_code}: {r.text[:300]}")


@dataclass
class RunningServer:
    """A running server for a launched run (the ``running_server`` fixture): the launch's extra ``overrides``
    and ``env``; ``requests()`` lists the paths of the requests it served since the fixture began."""

    overrides: list[str]
    env: dict[str, str]
    request_log: Path
    log_offset: int

    def requests(self) -> list[str]:
        import json

        with open(self.request_log, "rb") as f:
            f.seek(self.log_offset)
            return [json.loads(line)["path"] for line in f.read().decode().splitlines() if line.strip()]


class VLLMTestServer:
    """The session server plus what tests need to talk to it."""

    def __init__(self, proc: ServerProcess, model_dir: str, start_seconds: float, request_log: Path | None = None):
        self.proc = proc
        self.request_log = request_log  # one JSON line per request served (``tandemrl.inference.request_log``)
        self.gate_dir = gate_dir_for(proc.log_file)
        self.backend = VLLMBackend(request_timeout=120.0, control_timeout=60.0, update_timeout=120.0)
        self.model_dir = model_dir
        self.start_seconds = start_seconds

    @property
    def url(self) -> str:
        return self.proc.base_url

    def gate(self, prompt: list[int]) -> Gate:
        """Arm the server's hold hook for requests starting with ``prompt`` (disarm: leave the ``with``)."""
        return Gate(self.gate_dir).arm(prompt)

    def call(self, req: HttpRequest) -> Any:
        """Send one built request; non-2xx raises with the status and a snippet of the body."""
        r = requests.request(
            req.method, self.url + req.path, json=req.json, timeout=req.timeout or 60.0, headers=auth_headers()
        )
        if not r.ok:
            raise RuntimeError(f"{req.method} {req.path} -> HTTP {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else None

    def generate(self, prompt: list[int], max_new_tokens: int, rid: str | None = None) -> GenerateChunk:
        req = ModelRequest(input_ids=list(prompt), metadata={"ignore_eos": True})
        if rid is not None:
            req.rid = rid
        req.gconfig.greedy = True
        return self.backend.parse_generate(self.call(self.backend.build_generate(req, [], max_new_tokens, 0)))

    def call_in_thread(self, req: HttpRequest) -> tuple[threading.Thread, dict[str, Any]]:
        """Start ``req`` in the background (``/collective_rpc`` blocks until the broadcast ends)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = self.call(req)
            except Exception as e:  # noqa: BLE001 - re-raised by the test thread
                box["error"] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th, box


def gate_dir_for(log_file: str) -> str:
    """Where a test server started by ``launch_test_server`` looks for an armed gate."""
    return str(Path(log_file).parent / "gate")


def launch_test_server(
    model_dir: str, log_file: str, token: str | None = None, request_log: str | None = None, **extra: Any
) -> ServerProcess:
    """``launch_server`` with ``VLLM_EXTRA`` (+ ``extra``) and the vllm_gate hook importable and pointed at its dir."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {GATE_ENV: gate_dir_for(log_file), "PYTHONPATH": path}
    return launch_server(
        VLLMBackend(),
        model_dir,
        extra={**VLLM_EXTRA, **extra},
        log_file=log_file,
        env=env,
        token=token,
        request_log=request_log,
    )


def start_vllm_server(model_dir: str, log_file: str) -> VLLMTestServer:
    start = time.monotonic()
    # Like the launchers: a per-run token the server requires and this process's clients send.
    os.environ[TOKEN_ENV] = new_token()
    request_log = Path(log_file).with_suffix(".requests.jsonl")
    request_log.touch()
    proc = launch_test_server(model_dir, log_file, token=os.environ[TOKEN_ENV], request_log=str(request_log))
    try:
        proc.wait_healthy(START_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    return VLLMTestServer(proc, model_dir, time.monotonic() - start, request_log)


def join(th: threading.Thread, box: dict[str, Any], timeout: float = 120.0) -> Any:
    th.join(timeout)
    if th.is_alive():
        raise TimeoutError(f"background request still running after {timeout}s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ------------------------------------------------------------------------- HF reference


def load_hf(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@dataclass
class GreedyRef:
    prompt: list[int]
    ids: list[int]
    logprobs: list[float]
    min_gap: float  # smallest top-1 vs top-2 logit gap along the path


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[GreedyRef]:
    """fp32 greedy continuations of equal-length ``prompts`` (batched, no cache)."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf_greedy needs prompts of equal length")
    ids = torch.tensor(prompts)
    lps, gaps = [], []
    for _ in range(n):
        logits = model(ids, use_cache=False).logits[:, -1].float()
        top = torch.topk(logits, 2, dim=-1)
        tok = top.indices[:, 0]
        lps.append(torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])
        gaps.append(top.values[:, 0] - top.values[:, 1])
        ids = torch.cat([ids, tok[:, None]], dim=1)
    out_ids = ids[:, -n:].tolist()
    lp, gp = torch.stack(lps, 1).tolist(), torch.stack(gaps, 1).tolist()
    return [GreedyRef(p, i, lpi, min(g)) for p, i, lpi, g in zip(prompts, out_ids, lp, gp, strict=True)]


def decisive_prompt(model: torch.nn.Module, n: int, seed: int, candidates: int = 64, length: int = 8) -> GreedyRef:
    """Of ``candidates`` seeded random prompts, the one whose fp32 greedy path has the widest
    smallest top-2 logit gap, so bf16 rounding in the server cannot flip a greedy choice."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, int(model.config.vocab_size), (candidates, length), generator=g).tolist()
    return max(hf_greedy(model, prompts, n), key=lambda r: r.min_gap)


def perturbed_model(model_dir: str, seed: int, out_dir: Path | None = None) -> torch.nn.Module:
    """A seeded variant of the tiny model (saved as HF to ``out_dir`` if given).

    Every weight gets noise and lm_head is scaled x8: the variant's greedy path differs
    from the original's and has wider logit gaps.
    """
    model = load_hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        model.lm_head.weight.mul_(8.0)
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def assert_greedy_matches(chunk: GenerateChunk, ref: GreedyRef) -> None:
    """The server's greedy tokens equal fp32 HF greedy, and its logprobs are close (bf16 server)."""
    assert chunk.output_tokens == ref.ids, (
        f"server greedy {chunk.output_tokens} != HF greedy {ref.ids} (prompt {ref.prompt}, min gap {ref.min_gap:.4f})"
    )
    diff = max(abs(a - b) for a, b in zip(chunk.output_logprobs, ref.logprobs, strict=True))
    assert diff < 0.1, f"server logprobs {chunk.output_logprobs} vs HF {ref.logprobs}: max diff {diff}"


def restore_original(server: VLLMTestServer) -> None:
    """Back to the original weights, unpaused (every test ends with this)."""
    from tandemrl.api.inference import WeightUpdateMeta

    b = server.backend
    for req in b.build_update_from_disk(WeightUpdateMeta(type="disk", path=server.model_dir)):
        server.call(req)
    server.call(b.build_resume())


def weight_label(server: VLLMTestServer) -> str:
    return str(server.call(HttpRequest("GET", "/weight_info", None, 60.0))["weight_version"])


def restore_session_server(server: VLLMTestServer, label: str) -> None:
    """Original weights, unpaused, version label ``label`` (what every test must leave)."""
    restore_original(server)
    server.call(HttpRequest("POST", "/update_weight_version", {"new_version": label}, 60.0))
    assert server.call(HttpRequest("GET", "/is_paused", None, 60.0))["is_paused"] is False


def load_noisy_weights(server: VLLMTestServer, out_dir: Path, std: float = 0.05) -> None:
    """Give the server other weights: its model's, each tensor plus Gaussian noise of ``std`` (saved in ``out_dir``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tandemrl.api.inference import WeightUpdateMeta

    shutil.copytree(server.model_dir, out_dir)
    gen = torch.Generator().manual_seed(0)
    for f in out_dir.glob("*.safetensors"):
        tensors = load_file(f)
        noisy = {k: (t.float() + std * torch.randn(t.shape, generator=gen)).to(t.dtype) for k, t in tensors.items()}
        save_file(noisy, f, metadata={"format": "pt"})
    for req in server.backend.build_update_from_disk(WeightUpdateMeta(type="disk", path=str(out_dir))):
        server.call(req)
    server.call(server.backend.build_resume())
