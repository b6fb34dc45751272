"""Protocol tests of the inference backends: every request built and every reply parsed.

vLLM: request bodies are validated by, and example replies built with, the installed
vLLM 0.32 pydantic models; the server command is parsed by vLLM's own CLI parser.
SGLang: payloads follow SGLang's documented native API; those tests are NOT run against
a real SGLang server (it is not installed here).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandemrl.api import (
    GenerateChunk,
    InferenceBackend,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    VersionSpan,
    WeightUpdateMeta,
)
from tandemrl.api.types import ParallelStrategy
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.inference import BadServerPayload, get_backend
from tandemrl.inference.sglang import SGLangBackend
from tandemrl.inference.vllm import WORKER_EXTENSION, VLLMBackend
from tandemrl.weights.wire import parse_buckets_json

PROMPT = [5, 17, 42, 99]
SAMPLED = GenerationHyperparameters(
    max_new_tokens=16,
    min_new_tokens=4,
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    stop_token_ids=[2, 7],
    frequency_penalty=0.1,
)
GREEDY = SAMPLED.new(greedy=True)


def make_req(gconfig: GenerationHyperparameters = SAMPLED, **metadata: Any) -> ModelRequest:
    return ModelRequest(rid="rq-1", input_ids=list(PROMPT), gconfig=gconfig, metadata=metadata)


def assert_one_line_error(exc: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def collective_meta(world_size: int = 5, version: int | None = None) -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type="collective",
        group_addr="10.0.0.1",
        group_port=29555,
        world_size=world_size,
        comm_backend="gloo",
        version=version,
    )


# ======================================================================================
# Shared types
# ======================================================================================


def test_model_response_lengths() -> None:
    r = ModelResponse(input_tokens=[1, 2, 3], output_tokens=[4, 5], output_logprobs=[-0.1, -0.2])
    assert (r.input_len, r.output_len) == (3, 2)


def test_chunk_token_versions_fill_unlabelled_tokens_with_fallback() -> None:
    chunk = GenerateChunk(
        [1, 2, 3, 4, 5], [0.0] * 5, "abort", [VersionSpan(None, 0, 2), VersionSpan(4, 2, 4)]
    )  # token 4 is in no span
    assert chunk.token_versions(fallback=3) == [3, 3, 4, 4, 3]
    assert GenerateChunk([1, 2], [0.0, 0.0], "stop").token_versions(fallback=7) == [7, 7]


def test_from_disk_path_and_version() -> None:
    meta = WeightUpdateMeta.from_disk("/ckpt", "exp", "trial1")
    assert (meta.type, meta.path) == ("disk", "/ckpt/exp/trial1/weight_update")
    assert WeightUpdateMeta.from_disk("/ckpt").path == "/ckpt/weight_update"
    tagged = meta.with_version(3)
    assert tagged.version == 3 and meta.version is None and tagged.path == meta.path


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"type": "disk"}, "path"),
        ({"type": "nccl", "path": "/x"}, "type"),
        ({"type": "disk", "path": "/x", "bucket_size_mb": 0}, "bucket_size_mb"),
        ({"type": "collective", "world_size": 1, "group_port": 1234}, "world_size"),
        ({"type": "collective", "world_size": 3, "group_port": 0}, "group_port"),
    ],
)
def test_weight_update_meta_rejects_bad_fields(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as exc:
        WeightUpdateMeta(**kwargs)
    assert_one_line_error(exc, field)


def test_get_backend_and_protocol() -> None:
    assert isinstance(get_backend("vllm"), VLLMBackend)
    assert isinstance(get_backend("sglang", request_timeout=5.0), SGLangBackend)
    assert get_backend("sglang", request_timeout=5.0).request_timeout == 5.0
    for b in (VLLMBackend(), SGLangBackend()):
        assert isinstance(b, InferenceBackend)
    with pytest.raises(ValueError) as exc:
        get_backend("trtllm")
    assert_one_line_error(exc, "trtllm")
    with pytest.raises(ValueError) as exc:
        VLLMBackend(control_timeout=0)
    assert_one_line_error(exc, "control_timeout")


# ======================================================================================
# vLLM: requests
# ======================================================================================


@pytest.fixture(scope="module")
def vllm_models() -> Any:
    """vLLM's own request/response models and CLI parser (imported once: ~15 s)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.scale_out.token_in_token_out import protocol
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return protocol, make_arg_parser(FlexibleArgumentParser())


def test_vllm_generate_sampled() -> None:
    http = VLLMBackend(request_timeout=123.0).build_generate(make_req(seed=11), [8, 9], remaining=14, version=0)
    assert (http.method, http.path, http.timeout) == ("POST", "/inference/v1/generate", 123.0)
    body = http.json
    assert body is not None
    assert body["request_id"] == "rq-1" and body["stream"] is False
    assert body["token_ids"] == PROMPT + [8, 9]
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 14
    assert sp["min_tokens"] == 2  # 4 owed minus the 2 already generated
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"]) == (0.7, 0.9, 50, 0.05)
    assert sp["stop_token_ids"] == [2, 7] and sp["frequency_penalty"] == 0.1
    assert (sp["logprobs"], sp["n"], sp["seed"]) == (0, 1, 11)
    assert "stop" not in sp and sp["detokenize"] is False and "ignore_eos" not in sp
    # The prefix cache is keyed by weight version: requests of one version share it, of two never.
    salts = [VLLMBackend().build_generate(make_req(), [], 4, version=v).json["cache_salt"] for v in (0, 0, 1)]  # type: ignore[index]
    assert salts[0] == salts[1] != salts[2]


def test_vllm_generate_greedy_and_options() -> None:
    req = make_req(GREEDY.new(top_k=-1, stop=["\n\n"]), ignore_eos=True)
    sp = VLLMBackend().build_generate(req, [], remaining=16, version=0).json["sampling_params"]  # type: ignore[index]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"]) == (0.0, 1.0, 0, 0.0)
    assert sp["stop"] == ["\n\n"] and sp["detokenize"] is True and sp["ignore_eos"] is True
    assert "seed" not in sp
    sampled_no_topk = VLLMBackend().build_generate(make_req(SAMPLED.new(top_k=-1)), [], 16, 0)
    assert sampled_no_topk.json["sampling_params"]["top_k"] == 0  # type: ignore[index]


@pytest.mark.parametrize("so_far, remaining, want_min", [([], 16, 4), ([1] * 6, 10, 0), ([1], 2, 2)])
@pytest.mark.parametrize("backend, key", [(VLLMBackend(), "min_tokens"), (SGLangBackend(), "min_new_tokens")])
def test_min_tokens_follow_output_so_far_and_budget(
    backend: InferenceBackend, key: str, so_far: list[int], remaining: int, want_min: int
) -> None:
    body = backend.build_generate(make_req(), so_far, remaining, version=0).json
    assert body is not None and body["sampling_params"][key] == want_min


@pytest.mark.parametrize("backend", [VLLMBackend(), SGLangBackend()])
def test_generate_rejects_bad_budget_and_empty_prompt(backend: InferenceBackend) -> None:
    with pytest.raises(ValueError) as exc:
        backend.build_generate(make_req(), [], remaining=0, version=0)
    assert_one_line_error(exc, "remaining", backend.name)
    with pytest.raises(ValueError) as exc:
        backend.build_generate(ModelRequest(rid="x", input_ids=[]), [], remaining=4, version=0)
    assert_one_line_error(exc, "input_ids", backend.name)


def test_vllm_requests_validate_against_installed_vllm(vllm_models: Any) -> None:
    protocol, _ = vllm_models
    backend = VLLMBackend()
    cases = [
        (make_req(seed=3), [8, 9], 14),
        (make_req(GREEDY), [], 16),
        (make_req(SAMPLED.new(top_k=-1, stop=["\n"])), [1, 2, 3, 4, 5, 6], 1),
    ]
    for version, (req, so_far, remaining) in enumerate(cases):
        body = backend.build_generate(req, so_far, remaining, version=version).json
        parsed = protocol.GenerateRequest.model_validate(body)
        assert parsed.cache_salt == body["cache_salt"]  # type: ignore[index]
        sp = parsed.sampling_params
        assert parsed.token_ids == req.input_ids + so_far and parsed.request_id == req.rid
        assert sp.max_tokens == remaining and sp.min_tokens <= sp.max_tokens
        assert sp.logprobs == 0 and sp.n == 1
        assert sp.stop_token_ids == req.gconfig.stop_token_ids
        if req.gconfig.greedy:
            assert sp.temperature == 0.0
        else:
            assert sp.temperature == req.gconfig.temperature and sp.top_p == req.gconfig.top_p


def test_vllm_control_requests() -> None:
    b = VLLMBackend(control_timeout=7.0)
    pause, resume, health = b.build_pause(), b.build_resume(), b.build_health()
    assert (pause.method, pause.path, pause.timeout) == ("POST", "/pause?mode=abort", 7.0)
    assert b.build_pause("abort") == pause
    # Without clear_cache=false vLLM would preempt the kept requests (their KV dropped).
    assert b.build_pause("keep").path == "/pause?mode=keep&clear_cache=false"
    with pytest.raises(ValueError) as exc:
        b.build_pause("wait")  # type: ignore[arg-type]
    assert_one_line_error(exc, "InferenceClientConfig.pause_mode", "vllm")
    assert (resume.method, resume.path) == ("POST", "/resume")
    assert (health.method, health.path) == ("GET", "/health")
    assert (b.build_version_get().method, b.build_version_get().path) == ("GET", "/weight_info")
    setv = b.build_set_version(5)
    assert (setv.method, setv.path, setv.json) == ("POST", "/update_weight_version", {"new_version": "5"})
    abort = b.build_abort_all()
    assert (abort.method, abort.path, abort.json) == ("POST", "/abort_requests", {})
    assert (b.build_flush_cache().method, b.build_flush_cache().path) == ("POST", "/reset_prefix_cache")


def test_vllm_parse_version() -> None:
    b = VLLMBackend()
    assert b.parse_version({"weight_version": "3"}) == 3
    assert b.parse_version({"weight_version": "default"}) is None
    with pytest.raises(ValueError) as exc:
        b.parse_version({"version": "3"})
    assert_one_line_error(exc, "weight_version", "vllm")


def test_vllm_update_from_disk_steps() -> None:
    b = VLLMBackend(update_timeout=99.0)
    meta = WeightUpdateMeta.from_disk("/ckpt")
    rpc, reset = b.build_update_from_disk(meta)
    assert (rpc.method, rpc.path, rpc.timeout) == ("POST", "/collective_rpc", 99.0)
    assert rpc.json == {"method": "tandemrl_update_from_disk", "kwargs": {"path": meta.path}, "timeout": 99.0}
    assert (reset.method, reset.path) == ("POST", "/reset_prefix_cache")
    steps = b.build_update_from_disk(meta.with_version(4))
    assert [s.path for s in steps] == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]
    assert steps[-1].json == {"new_version": "4"}
    with pytest.raises(ValueError) as exc:
        b.build_update_from_disk(collective_meta())
    assert_one_line_error(exc, "disk", "vllm")


def test_vllm_collective_requests() -> None:
    b = VLLMBackend()
    meta = collective_meta(world_size=5)
    init = b.build_init_weight_group(meta, rank_offset=3)
    assert (init.method, init.path) == ("POST", "/collective_rpc")
    assert init.json is not None and init.json["method"] == "tandemrl_init_weight_group"
    # /collective_rpc forwards strings only
    assert init.json["kwargs"] == {
        "host": "10.0.0.1",
        "port": "29555",
        "world_size": "5",
        "rank": "3",
        "backend": "gloo",
        "timeout": "600.0",
    }
    for bad in (0, 5):
        with pytest.raises(ValueError) as exc:
            b.build_init_weight_group(meta, rank_offset=bad)
        assert_one_line_error(exc, "rank_offset", str(bad))
    leave = b.build_leave_weight_group(meta)  # the extension's method, also used by the real-server tests
    assert (leave.method, leave.path) == ("POST", "/collective_rpc")
    assert leave.json is not None and leave.json["method"] == "tandemrl_destroy_weight_group"
    specs = [ParamSpec("model.embed_tokens.weight", (64, 16), "bfloat16"), ParamSpec("lm_head.bias", (64,), "float32")]
    assert b.multi_bucket_collective is True
    # Every bucket in ONE RPC, in the multi-bucket JSON the extension parses back exactly.
    recv = b.build_update_from_collective(meta, [specs[:1], specs[1:]])
    assert recv.json is not None and recv.json["method"] == "tandemrl_recv_weights"
    meta_json = recv.json["kwargs"]["meta_json"]
    assert json.loads(meta_json) == [
        [["model.embed_tokens.weight", "bfloat16", [64, 16]]],
        [["lm_head.bias", "float32", [64]]],
    ]
    assert parse_buckets_json(meta_json) == [specs[:1], specs[1:]]
    for bad in ([], [specs, []]):
        with pytest.raises(ValueError) as exc:
            b.build_update_from_collective(meta, bad)
        assert_one_line_error(exc, "param_specs", "vllm")
    with pytest.raises(ValueError) as exc:
        b.build_init_weight_group(WeightUpdateMeta.from_disk("/x"), 1)
    assert_one_line_error(exc, "collective")


def test_vllm_server_command_parses_with_vllm_cli(vllm_models: Any) -> None:
    _, parser = vllm_models
    b = VLLMBackend()
    cmd = b.server_command(
        "/models/tiny",
        "127.0.0.1",
        18431,
        ParallelStrategy(dp=2, tp=2, pp=2),
        {"max_model_len": 512, "dtype": "bfloat16", "enforce_eager": True, "prefix_caching": False},
    )
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = parser.parse_args(cmd[3:])
    assert (args.model, args.host, args.port) == ("/models/tiny", "127.0.0.1", 18431)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 2, 2)
    assert args.enable_scale_out is True and args.logprobs_mode == "processed_logprobs"
    assert args.worker_extension_cls == WORKER_EXTENSION
    assert (args.dtype, args.max_model_len, args.seed, args.enforce_eager) == ("bfloat16", 512, 0, True)
    assert "--prefix-caching" not in cmd  # False drops the flag
    single = b.server_command("/m", "h", 1, ParallelStrategy(), {})
    assert "--data-parallel-size" not in single and single[single.index("--tensor-parallel-size") + 1] == "1"
    assert b.server_env() == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with pytest.raises(ValueError) as exc:
        b.server_command("/m", "h", 1, ParallelStrategy(), {"tensor-parallel-size": 4})
    assert_one_line_error(exc, "tensor-parallel-size", "set by tandemrl")


# ======================================================================================
# vLLM: replies
# ======================================================================================


def vllm_reply(
    tokens: list[int], finish: str | None = "stop", spans: list[dict[str, Any]] | None = None, **choice: Any
) -> dict[str, Any]:
    """A /inference/v1/generate reply shaped as measured in the CPU-feasibility notes."""
    body: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": tokens,
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": -0.5 - i, "rank": 1, "top_logprobs": []} for i, t in enumerate(tokens)
            ]
        },
        "weight_versions": spans,
    }
    body.update(choice)
    return {"request_id": "generate-tokens-rq-1", "choices": [body], "usage": {"prompt_tokens": 4}}


def test_vllm_parse_stop_length_abort() -> None:
    b = VLLMBackend()
    done = b.parse_generate(vllm_reply([11, 12, 7], "stop", [{"version": "default", "start": 0, "end": 3}]))
    assert done.output_tokens == [11, 12, 7] and done.stop_reason == "stop"
    assert done.output_logprobs == [-0.5, -1.5, -2.5]
    assert done.version_spans == [VersionSpan(None, 0, 3)] and done.token_versions(2) == [2, 2, 2]

    assert b.parse_generate(vllm_reply([1, 2], "length")).stop_reason == "length"
    assert b.parse_generate(vllm_reply([1, 2], "repetition")).stop_reason == "stop"

    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    partial = b.parse_generate(vllm_reply([3, 4, 5, 6, 8], "abort", spans))
    assert partial.stop_reason == "abort" and partial.output_tokens == [3, 4, 5, 6, 8]
    assert partial.token_versions(fallback=0) == [1, 1, 2, 2, 2]


def test_vllm_parse_abort_before_first_token() -> None:
    chunk = VLLMBackend().parse_generate(vllm_reply([], "abort", logprobs=None))
    assert (chunk.output_tokens, chunk.output_logprobs, chunk.stop_reason) == ([], [], "abort")
    assert chunk.version_spans is None


def test_vllm_parse_reply_built_by_installed_vllm(vllm_models: Any) -> None:
    protocol, _ = vllm_models
    from vllm.outputs import WeightVersionSpan

    content = [protocol.GenerateLogProbsContent(token_id=t, logprob=lp) for t, lp in [(9, -0.25), (2, -1.0)]]
    choice = protocol.GenerateTokensChoice(
        index=0,
        finish_reason="abort",
        token_ids=[9, 2],
        logprobs=protocol.GenerateLogProbs(content=content),
        weight_versions=[WeightVersionSpan(version="6", start=0, end=2)],
    )
    reply = protocol.GenerateTokensResponse(request_id="generate-tokens-rq-1", choices=[choice]).model_dump()
    chunk = VLLMBackend().parse_generate(json.loads(json.dumps(reply)))
    assert (chunk.output_tokens, chunk.output_logprobs, chunk.stop_reason) == ([9, 2], [-0.25, -1.0], "abort")
    assert chunk.token_versions(fallback=0) == [6, 6]


def _drop(reply: dict[str, Any], key: str) -> dict[str, Any]:
    reply["choices"][0].pop(key)
    return reply


@pytest.mark.parametrize(
    "reply, needle",
    [
        ({"request_id": "x"}, "choices"),
        ({"choices": []}, "choices"),
        (_drop(vllm_reply([1]), "token_ids"), "choices[0].token_ids"),
        (_drop(vllm_reply([1]), "finish_reason"), "choices[0].finish_reason"),
        (vllm_reply([1], "error"), "finish_reason"),
        (vllm_reply([1, 2], logprobs=None), "choices[0].logprobs.content"),
        (vllm_reply([1, 2], logprobs={"content": [{"token_id": 1, "logprob": -1.0}]}), "1 entries for 2"),
        (vllm_reply([1], logprobs={"content": [{"token_id": 4, "logprob": -1.0}]}), "token_id"),
        (vllm_reply([1], logprobs={"content": [{"token_id": 1}]}), "choices[0].logprobs.content[0].logprob"),
        (vllm_reply([1, "a"]), "non-integer"),
        (vllm_reply([1], spans=[{"version": "1", "start": 0}]), "weight_versions[0].end"),
        ({"error": {"message": "max_tokens too large\nsecond line", "code": 400}}, "max_tokens too large"),
    ],
)
def test_vllm_parse_malformed(reply: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        VLLMBackend().parse_generate(reply)
    assert isinstance(exc.value, BadServerPayload)
    assert_one_line_error(exc, needle, "vllm")


# ======================================================================================
# SGLang (protocol only; NOT run against a real SGLang server)
# ======================================================================================


def test_sglang_generate_sampled_not_run_against_real_server() -> None:
    http = SGLangBackend(request_timeout=50.0).build_generate(make_req(), [8, 9, 10], remaining=13, version=2)
    assert (http.method, http.path, http.timeout) == ("POST", "/generate", 50.0)
    body = http.json
    assert body is not None
    assert body["input_ids"] == PROMPT + [8, 9, 10]
    assert body["return_logprob"] is True and body["stream"] is False
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["min_new_tokens"]) == (13, 1)
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"]) == (0.7, 0.9, 50, 0.05)
    assert sp["stop_token_ids"] == [2, 7] and sp["frequency_penalty"] == 0.1
    assert "stop" not in sp and "ignore_eos" not in sp


def test_sglang_generate_greedy_not_run_against_real_server() -> None:
    sp = (
        SGLangBackend()
        .build_generate(make_req(GREEDY.new(stop=["###"]), ignore_eos=True), [], 16, 0)
        .json[  # type: ignore[index]
            "sampling_params"
        ]
    )
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"]) == (0.0, 1.0, 1, 0.0)
    assert sp["stop"] == ["###"] and sp["ignore_eos"] is True
    no_topk = SGLangBackend().build_generate(make_req(SAMPLED.new(top_k=0)), [], 16, 0).json
    assert no_topk["sampling_params"]["top_k"] == -1  # type: ignore[index]


def sglang_reply(tokens: list[int], finish: dict[str, Any] | None, version: str | None = "default") -> dict[str, Any]:
    """A /generate reply shaped per SGLang's native-API docs."""
    meta: dict[str, Any] = {
        "id": "abc",
        "finish_reason": finish,
        "prompt_tokens": 4,
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(tokens)],
        "e2e_latency": 0.1,
    }
    if version is not None:
        meta["weight_version"] = version
    return {"text": "", "output_ids": list(tokens), "meta_info": meta}


def test_sglang_parse_not_run_against_real_server() -> None:
    b = SGLangBackend()
    done = b.parse_generate(sglang_reply([11, 12, 2], {"type": "stop", "matched": 2}, version="3"))
    assert done.output_tokens == [11, 12, 2] and done.output_logprobs == [-0.25, -0.5, -0.75]
    assert done.stop_reason == "stop" and done.token_versions(fallback=0) == [3, 3, 3]
    length = b.parse_generate(sglang_reply([1, 2], {"type": "length", "length": 2}, version=None))
    assert length.stop_reason == "length" and length.version_spans is None
    partial = b.parse_generate(sglang_reply([5, 6], {"type": "abort", "message": "paused"}))
    assert partial.stop_reason == "abort" and partial.token_versions(fallback=8) == [8, 8]  # "default" -> fallback
    empty = sglang_reply([], {"type": "abort", "message": "paused"})
    empty["meta_info"].pop("output_token_logprobs")
    assert b.parse_generate(empty).output_tokens == []
    assert b.parse_generate([sglang_reply([4], {"type": "stop"})]).output_tokens == [4]  # type: ignore[arg-type]


def _sg_mutate(path: str, value: Any = None, drop: bool = False) -> dict[str, Any]:
    reply = sglang_reply([1, 2], {"type": "stop", "matched": 2})
    *parents, last = path.split(".")
    target = reply
    for p in parents:
        target = target[p]
    if drop:
        target.pop(last)
    else:
        target[last] = value
    return reply


@pytest.mark.parametrize(
    "reply, needle",
    [
        (_sg_mutate("meta_info", drop=True), "meta_info"),
        (_sg_mutate("meta_info.finish_reason", drop=True), "meta_info.finish_reason"),
        (_sg_mutate("meta_info.finish_reason", {"matched": 2}), "meta_info.finish_reason.type"),
        (_sg_mutate("meta_info.finish_reason", {"type": "timeout"}), "finish_reason.type"),
        (_sg_mutate("meta_info.output_token_logprobs", drop=True), "meta_info.output_token_logprobs"),
        (_sg_mutate("meta_info.output_token_logprobs", [[-0.1, 1, None], [-0.2]]), "output_token_logprobs[1]"),
        (_sg_mutate("meta_info.output_token_logprobs", [[None, 1, None], [-0.2, 2]]), "output_token_logprobs[0]"),
        (_sg_mutate("output_ids", [1, 3]), "output_ids"),
        ({"error": {"message": "Duplicate request ID"}}, "Duplicate request ID"),
        ([sglang_reply([1], {"type": "stop"})] * 2, "list of 2"),
    ],
)
def test_sglang_parse_malformed_not_run_against_real_server(reply: Any, needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        SGLangBackend().parse_generate(reply)
    assert isinstance(exc.value, BadServerPayload)
    assert_one_line_error(exc, needle, "sglang")


def test_sglang_control_requests_not_run_against_real_server() -> None:
    b = SGLangBackend(control_timeout=9.0)
    with pytest.raises(ValueError) as exc:
        b.build_pause("keep")
    assert_one_line_error(exc, "InferenceClientConfig.pause_mode", "sglang")
    pause = b.build_pause()
    assert (pause.method, pause.path, pause.json, pause.timeout) == (
        "POST",
        "/pause_generation",
        {"mode": "abort"},
        9.0,
    )
    assert (b.build_resume().method, b.build_resume().path) == ("POST", "/continue_generation")
    assert (b.build_health().method, b.build_health().path) == ("GET", "/health")
    assert (b.build_version_get().method, b.build_version_get().path) == ("GET", "/get_model_info")
    assert b.parse_version({"model_path": "/m", "weight_version": "12"}) == 12
    with pytest.raises(ValueError) as exc:
        b.parse_version({"model_path": "/m"})
    assert_one_line_error(exc, "weight_version", "sglang")
    setv = b.build_set_version(6)
    assert (setv.path, setv.json) == ("/update_weight_version", {"new_version": "6", "abort_all_requests": False})
    abort = b.build_abort_all()
    assert (abort.method, abort.path, abort.json) == ("POST", "/abort_request", {"abort_all": True})
    assert (b.build_flush_cache().method, b.build_flush_cache().path) == ("POST", "/flush_cache")


def test_sglang_weight_updates_not_run_against_real_server() -> None:
    b = SGLangBackend(update_timeout=77.0)
    meta = WeightUpdateMeta.from_disk("/ckpt", "e", "t")
    (load,) = b.build_update_from_disk(meta)
    assert (load.method, load.path, load.json, load.timeout) == (
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/ckpt/e/t/weight_update"},
        77.0,
    )
    steps = b.build_update_from_disk(meta.with_version(2))
    assert [s.path for s in steps] == ["/update_weights_from_disk", "/update_weight_version"]

    coll = collective_meta(world_size=5, version=3)
    init = b.build_init_weight_group(coll, rank_offset=1)
    assert (init.method, init.path) == ("POST", "/init_weights_update_group")
    assert init.json == {
        "master_address": "10.0.0.1",
        "master_port": 29555,
        "rank_offset": 1,
        "world_size": 5,
        "group_name": "tandemrl_weight_update",
        "backend": "gloo",
    }
    leave = b.build_leave_weight_group(coll)
    assert (leave.method, leave.path, leave.json) == (
        "POST",
        "/destroy_weights_update_group",
        {"group_name": "tandemrl_weight_update"},
    )
    specs = [ParamSpec("a.weight", (4, 2), "bfloat16"), ParamSpec("b.bias", (4,), "float32")]
    assert b.multi_bucket_collective is False  # the documented API describes one bucket per call
    upd = b.build_update_from_collective(coll, [specs])
    assert upd.path == "/update_weights_from_distributed"
    assert upd.json == {
        "names": ["a.weight", "b.bias"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[4, 2], [4]],
        "group_name": "tandemrl_weight_update",
        "flush_cache": True,
        "weight_version": "3",
    }
    with pytest.raises(ValueError) as exc:
        b.build_update_from_collective(coll, [specs[:1], specs[1:]])
    assert_one_line_error(exc, "at most 1 bucket", "sglang")
    with pytest.raises(ValueError) as exc:
        b.build_init_weight_group(coll, rank_offset=5)
    assert_one_line_error(exc, "rank_offset", "sglang")
    with pytest.raises(ValueError) as exc:
        b.build_update_from_disk(coll)
    assert_one_line_error(exc, "disk", "sglang")


def test_sglang_server_command_not_run_against_real_server() -> None:
    b = SGLangBackend()
    cmd = b.server_command("/m", "0.0.0.0", 30000, ParallelStrategy(dp=2, tp=4), {"mem_fraction_static": 0.8})
    assert cmd[1:5] == ["-m", "sglang.launch_server", "--model-path", "/m"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "30000"
    assert (flags["--tp-size"], flags["--dp-size"], flags["--mem-fraction-static"]) == ("4", "2", "0.8")
    assert "--pp-size" not in cmd
    assert "--pp-size" in b.server_command("/m", "h", 1, ParallelStrategy(pp=2), {})
    assert b.server_env() == {}
    with pytest.raises(ValueError) as exc:
        b.server_command("/m", "h", 1, ParallelStrategy(), {"tp_size": 2})
    assert_one_line_error(exc, "tp_size", "set by tandemrl")
