"""The teacher side of on-policy distillation: scoring requests (vLLM and SGLang builders/parsers),
teacher logprobs from a real vLLM server against transformers, and TeacherScoredWorkflow around the
RLVR workflow on the session server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm_server import VLLMTestServer, load_hf, perturbed_model

from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.inference.backend import BadServerPayload
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.inference.sglang import SGLangBackend
from tandemrl.inference.vllm import VLLMBackend
from tandemrl.models.hf import load_hf_tokenizer
from tandemrl.workflows.distill import TeacherScoredWorkflow, connect_teacher, teacher_addresses
from tandemrl.workflows.rlvr import RLVRWorkflow

# bf16 server vs fp32 transformers on the tiny model; a different model is off by far more (checked below).
MAX_ABS_DIFF = 0.05


# ------------------------------------------------------------------ requests and replies (no server)
def test_vllm_prompt_logprobs_request_and_reply() -> None:
    b = VLLMBackend(request_timeout=7.0)
    req = b.build_prompt_logprobs([5, 6, 7], "r1")
    assert (req.method, req.path, req.timeout) == ("POST", "/inference/v1/generate", 7.0)
    assert req.json is not None and req.json["token_ids"] == [5, 6, 7] and req.json["request_id"] == "r1"
    assert req.json["sampling_params"]["prompt_logprobs"] == 0 and req.json["sampling_params"]["max_tokens"] == 1
    reply = {"prompt_logprobs": [None, {"6": {"logprob": -1.5, "rank": 3}}, {"7": {"logprob": -0.25}}]}
    assert b.parse_prompt_logprobs(reply, [5, 6, 7]) == [-1.5, -0.25]
    with pytest.raises(BadServerPayload, match=r"prompt_logprobs\[2\]\.7"):
        b.parse_prompt_logprobs({"prompt_logprobs": [None, reply["prompt_logprobs"][1], {"9": {}}]}, [5, 6, 7])
    with pytest.raises(BadServerPayload, match="2 entries for 3 prompt tokens"):
        b.parse_prompt_logprobs({"prompt_logprobs": [None, {}]}, [5, 6, 7])
    for bad in ([5], [5, -1], [5, True]):
        with pytest.raises(ValueError, match="build_prompt_logprobs"):
            b.build_prompt_logprobs(bad, "r")


def test_sglang_prompt_logprobs_request_and_reply_not_run_against_real_server() -> None:
    b = SGLangBackend()
    req = b.build_prompt_logprobs([5, 6, 7], "r1")
    assert req.path == "/generate" and req.json is not None
    assert req.json["input_ids"] == [5, 6, 7] and req.json["logprob_start_len"] == 0 and req.json["return_logprob"]
    reply = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None], [-0.25, 7, None]]}}
    assert b.parse_prompt_logprobs(reply, [5, 6, 7]) == [-1.5, -0.25]
    with pytest.raises(BadServerPayload, match="other tokens"):
        b.parse_prompt_logprobs(reply, [5, 6, 8])


def test_teacher_addresses_come_from_config_or_lookup_never_the_policy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEMRL_LLM_SERVER_ADDRS", "127.0.0.1:9")  # the student's servers: never used
    with pytest.raises(ValueError, match=r"^teacher\.server_addrs: empty") as exc:
        teacher_addresses(InferenceClientConfig())
    assert "\n" not in str(exc.value)
    assert teacher_addresses(InferenceClientConfig(server_addrs=["h:1"])) == ["h:1"]
    assert teacher_addresses(InferenceClientConfig(), lookup=lambda name: {"teacher": ["h:2"]}[name]) == ["h:2"]
    with pytest.raises(ValueError, match="teacher.server_addrs"):
        teacher_addresses(InferenceClientConfig(server_addrs=["nohostport"]))


# ------------------------------------------------------------------ a real vLLM server as the teacher
def _addr(server: VLLMTestServer) -> str:
    return server.url.split("://", 1)[1]


@pytest.fixture(scope="module")
def teacher(vllm_server: VLLMTestServer) -> Iterator[RemoteInferenceClient]:
    client = connect_teacher(InferenceClientConfig(server_addrs=[_addr(vllm_server)], setup_timeout=60.0))
    yield client
    client.destroy()


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    x = torch.tensor([ids])
    lp = torch.log_softmax(model(x, use_cache=False).logits[0].float(), -1)
    return lp[:-1].gather(-1, x[0, 1:, None]).squeeze(-1).tolist()


def test_teacher_logprobs_match_transformers(vllm_server: VLLMTestServer, teacher: RemoteInferenceClient) -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 1000, (12,), generator=g).tolist()
    ids = prompt + vllm_server.generate(prompt, 20).output_tokens  # a prompt and what a policy sampled
    got = asyncio.run(teacher.aprompt_logprobs(ids))
    assert len(got) == len(ids) - 1
    ref = _hf_logprobs(load_hf(vllm_server.model_dir), ids)
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    assert diff < MAX_ABS_DIFF, f"teacher {got} vs transformers {ref}: max |diff| {diff}"
    # Control: another model's logprobs of the same tokens are far off, so the bound can fail.
    other = _hf_logprobs(perturbed_model(vllm_server.model_dir, seed=11), ids)
    assert max(abs(a - b) for a, b in zip(got, other, strict=True)) > 10 * MAX_ABS_DIFF


def _reward(**_: Any) -> float:
    return 1.0


def test_teacher_scored_workflow_adds_teacher_logprobs_on_generated_tokens(
    vllm_server: VLLMTestServer, teacher: RemoteInferenceClient
) -> None:
    """Student and teacher are the same model here, so at temperature 1 the teacher's logprobs of
    the sampled tokens equal the sampler's own (up to bf16 batch effects): reverse KL ~ 0."""
    student = RemoteInferenceClient.for_backend(
        "vllm", InferenceClientConfig(server_addrs=[_addr(vllm_server)], setup_timeout=60.0)
    )
    student.initialize()
    gconfig = GenerationHyperparameters(n_samples=3, max_new_tokens=12, temperature=1.0)
    inner = RLVRWorkflow(_reward, gconfig, load_hf_tokenizer(vllm_server.model_dir))
    row = {"messages": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}], "answer": "7"}
    batch = asyncio.run(TeacherScoredWorkflow(inner, teacher).arun_episode(student, row))
    student.destroy()
    assert batch is not None
    mask = batch["loss_mask"].bool()
    t = batch["teacher_logprobs"]
    assert t.shape == batch["logprobs"].shape and t.dtype == torch.float32
    assert mask.sum() > 0 and bool((t[~mask] == 0).all()) and bool((t[mask] < 0).all())
    diff = (t - batch["logprobs"])[mask].abs().max().item()
    assert diff < MAX_ABS_DIFF, f"teacher vs behaviour logprobs of the same model: max |diff| {diff}"
