"""SGLang request builder/parser, written against SGLang's documented native HTTP API.

Token-in/token-out via ``POST /generate`` with ``input_ids`` and ``return_logprob``;
``/pause_generation`` (mode "abort": in-flight requests return partial output with
``finish_reason.type == "abort"``) and ``/continue_generation`` bracket weight updates,
which go through ``/update_weights_from_disk`` or ``/init_weights_update_group`` +
``/update_weights_from_distributed``. Not exercised against a real SGLang server here
(SGLang is not installed); the shapes follow SGLang's docs and ``io_struct.py``.
Request metadata ``seed`` (int, sent as ``sampling_seed``) and ``ignore_eos`` (bool) are forwarded when present.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tandemrl.api.inference import (
    GenerateChunk,
    HttpRequest,
    ModelRequest,
    ParamSpec,
    PauseMode,
    StopReason,
    VersionSpan,
    WeightUpdateMeta,
)
from tandemrl.inference.backend import (
    BadServerPayload,
    TimeoutsMixin,
    check_buckets,
    check_budget,
    check_collective,
    check_scoring_ids,
    cli_flags,
    flag_name,
    int_list,
    min_tokens_left,
    parse_version_label,
    require,
    require_list,
    server_error,
)

if TYPE_CHECKING:
    from tandemrl.api.types import ParallelStrategy

_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_FIXED_FLAGS = {"model_path", "host", "port", "tp_size", "dp_size", "pp_size"}


class SGLangBackend(TimeoutsMixin):
    """Builds and parses SGLang HTTP calls."""

    name = "sglang"
    parallel_dims = "dtp"  # allocation_mode dims it serves with: data, tensor, pipeline
    # /update_weights_from_distributed describes one bucket per request.
    multi_bucket_collective = False
    features: frozenset[str] = frozenset()  # no token checks, middleware, run-time adapters or judge here
    deterministic_flags: dict[str, Any] = {}  # seeded sampling needs no server flag (nothing measured: CUDA-only)
    dtypes = ("auto", "half", "float16", "bfloat16", "float", "float32")  # SGLang's --dtype choices

    # ---- generation ----------------------------------------------------------------------

    def build_generate(self, req: ModelRequest, output_so_far: list[int], remaining: int, version: int) -> HttpRequest:
        """``version`` is not sent: the reply's ``meta_info.weight_version`` labels the chunk."""
        input_ids = check_budget(req, output_so_far, remaining, self.name)
        g = req.gconfig
        params: dict[str, Any] = {
            "max_new_tokens": remaining,
            "min_new_tokens": min_tokens_left(req, output_so_far, remaining),
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": 1.0 if g.greedy else g.top_p,
            "top_k": 1 if g.greedy else (g.top_k if g.top_k > 0 else -1),  # -1 disables top-k
            "min_p": 0.0 if g.greedy else g.min_p,
            "stop_token_ids": list(g.stop_token_ids),
            "frequency_penalty": g.frequency_penalty,
        }
        if g.stop:
            params["stop"] = list(g.stop)
        if req.metadata.get("seed") is not None:  # per-request seed (SGLang's SamplingParams.sampling_seed)
            params["sampling_seed"] = int(req.metadata["seed"])
        if req.metadata.get("ignore_eos"):
            params["ignore_eos"] = True
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "stream": False}
        return HttpRequest("POST", "/generate", body, self.request_timeout)

    def parse_generate(self, payload: dict[str, Any]) -> GenerateChunk:
        if isinstance(payload, list):  # a batch reply; we only ever send one prompt
            if len(payload) != 1:
                raise BadServerPayload(f"{self.name}: expected one generate result, got a list of {len(payload)}")
            payload = payload[0]
        server_error(payload, self.name)
        meta = require(payload, "meta_info", self.name, "")
        finish = require(meta, "finish_reason", self.name, "meta_info")
        kind = require(finish, "type", self.name, "meta_info.finish_reason")
        if kind not in _FINISH:
            raise BadServerPayload(f"{self.name}: unknown 'meta_info.finish_reason.type' {kind!r}")
        ids = payload.get("output_ids")
        ids = None if ids is None else int_list(ids, "output_ids", self.name)
        if ids == [] and meta.get("output_token_logprobs") is None:
            triples: list[Any] = []  # an abort before the first token may carry no logprobs
        else:
            triples = require_list(meta, "output_token_logprobs", self.name, "meta_info")
        tokens, logprobs = _split_triples(triples)
        if ids is not None and ids != tokens:
            raise BadServerPayload(
                f"{self.name}: 'output_ids' ({len(ids)} tokens) disagree with "
                f"'meta_info.output_token_logprobs' ({len(tokens)} tokens)"
            )
        spans = None
        if meta.get("weight_version") is not None:
            spans = [VersionSpan(parse_version_label(meta["weight_version"]), 0, len(tokens))]
        return GenerateChunk(tokens, logprobs, _FINISH[kind], spans)

    def build_prompt_logprobs(self, token_ids: list[int], rid: str) -> HttpRequest:
        """``/generate`` returning input-token logprobs from position 0 (``logprob_start_len``), one greedy token."""
        ids = check_scoring_ids(token_ids, self.name)
        params = {"max_new_tokens": 1, "temperature": 0.0}
        body = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": 0,
            "stream": False,
        }
        return HttpRequest("POST", "/generate", body, self.request_timeout)

    def parse_prompt_logprobs(self, payload: dict[str, Any], token_ids: list[int]) -> list[float]:
        """``meta_info.input_token_logprobs``: ``[logprob, token_id, text]`` per input token, the first logprob null."""
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]
        server_error(payload, self.name)
        meta = require(payload, "meta_info", self.name, "")
        triples = require_list(meta, "input_token_logprobs", self.name, "meta_info")
        if len(triples) != len(token_ids):
            raise BadServerPayload(
                f"{self.name}: 'meta_info.input_token_logprobs' has {len(triples)} entries for {len(token_ids)} tokens"
            )
        tokens, logprobs = _split_triples(triples[1:], "input_token_logprobs", first=1)
        if tokens != list(token_ids[1:]):
            raise BadServerPayload(f"{self.name}: 'meta_info.input_token_logprobs' scored other tokens than sent")
        return logprobs

    # ---- control ---------------------------------------------------------------------------

    def build_pause(self, mode: PauseMode = "abort") -> HttpRequest:
        """Abort only: keeping requests over an update is implemented for vLLM alone."""
        if mode != "abort":
            raise ValueError(f"{self.name}: InferenceClientConfig.pause_mode={mode!r} is not supported; use 'abort'")
        return HttpRequest("POST", "/pause_generation", {"mode": "abort"}, self.control_timeout)

    def build_resume(self) -> HttpRequest:
        return HttpRequest("POST", "/continue_generation", {}, self.control_timeout)

    def build_sleep(self, level: int) -> HttpRequest:
        """Release weights and KV cache of a paused server (any level >= 1)."""
        return HttpRequest("POST", "/release_memory_occupation", {}, self.update_timeout)

    def build_wake_up(self) -> HttpRequest:
        return HttpRequest("POST", "/resume_memory_occupation", {}, self.update_timeout)

    def build_health(self) -> HttpRequest:
        return HttpRequest("GET", "/health", None, self.control_timeout)

    def build_version_get(self) -> HttpRequest:
        return HttpRequest("GET", "/get_model_info", None, self.control_timeout)

    def parse_version(self, payload: dict[str, Any]) -> int | None:
        server_error(payload, self.name)
        return parse_version_label(require(payload, "weight_version", self.name, ""))

    def build_set_version(self, version: int) -> HttpRequest:
        """Relabel only: the pause already returned in-flight requests, so abort nothing."""
        body = {"new_version": str(version), "abort_all_requests": False}
        return HttpRequest("POST", "/update_weight_version", body, self.control_timeout)

    def build_abort_all(self) -> HttpRequest:
        return HttpRequest("POST", "/abort_request", {"abort_all": True}, self.control_timeout)

    def build_flush_cache(self) -> HttpRequest:
        return HttpRequest("POST", "/flush_cache", None, self.control_timeout)

    # ---- weight updates --------------------------------------------------------------------

    def build_update_from_disk(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        """Load (SGLang flushes its cache itself), then relabel if ``meta.version`` is set."""
        if meta.type != "disk" or not meta.path:
            raise ValueError(f"{self.name}: build_update_from_disk needs a 'disk' WeightUpdateMeta with a path")
        steps = [HttpRequest("POST", "/update_weights_from_disk", {"model_path": meta.path}, self.update_timeout)]
        if meta.version is not None:
            steps.append(self.build_set_version(meta.version))
        return steps

    def build_lora_probe(self) -> HttpRequest:
        return HttpRequest("GET", "/get_server_info", None, self.control_timeout)

    def parse_lora_probe(self, payload: dict[str, Any]) -> int:
        """0: adapter updates are not implemented for SGLang, so a LoRA trainer sends merged weights."""
        server_error(payload, self.name)
        return 0

    def build_load_adapter(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        raise ValueError(f"{self.name}: LoRA adapter updates are not supported; send merged weights (disk update)")

    def adapter_loaded(self) -> None:
        raise ValueError(f"{self.name}: LoRA adapter updates are not supported")

    def build_init_weight_group(self, meta: WeightUpdateMeta, rank_offset: int) -> HttpRequest:
        check_collective(meta, rank_offset, self.name)
        body = {
            "master_address": meta.group_addr,
            "master_port": meta.group_port,
            "rank_offset": rank_offset,
            "world_size": meta.world_size,
            "group_name": meta.group_name,
            "backend": meta.comm_backend,
        }
        return HttpRequest("POST", "/init_weights_update_group", body, self.update_timeout)

    def build_leave_weight_group(self, meta: WeightUpdateMeta) -> HttpRequest:
        body = {"group_name": meta.group_name}
        return HttpRequest("POST", "/destroy_weights_update_group", body, self.update_timeout)

    def build_update_from_collective(self, meta: WeightUpdateMeta, buckets: list[list[ParamSpec]]) -> HttpRequest:
        """One bucket: SGLang's ``/update_weights_from_distributed`` takes names/dtypes/shapes per call."""
        if meta.type != "collective":
            raise ValueError(f"{self.name}: build_update_from_collective needs a 'collective' WeightUpdateMeta")
        if meta.delta != "none":
            raise ValueError(f"{self.name}: weight_update_delta={meta.delta!r} needs the vllm backend (use 'none')")
        check_buckets(buckets, self.name, max_buckets=1)
        (param_specs,) = buckets
        body: dict[str, Any] = {
            "names": [p.name for p in param_specs],
            "dtypes": [p.dtype for p in param_specs],
            "shapes": [[int(d) for d in p.shape] for p in param_specs],
            "group_name": meta.group_name,
            "flush_cache": True,
        }
        if meta.version is not None:
            body["weight_version"] = str(meta.version)
        return HttpRequest("POST", "/update_weights_from_distributed", body, self.update_timeout)

    # ---- launching -------------------------------------------------------------------------

    def server_command(
        self, model_path: str, host: str, port: int, strategy: ParallelStrategy, extra: dict[str, Any]
    ) -> list[str]:
        """One SGLang server; ``extra`` adds flags (``{"mem_fraction_static": 0.8}``)."""
        normalized = {flag_name(k): v for k, v in extra.items()}
        clash = sorted(k for k in normalized if k in _FIXED_FLAGS)
        if clash:
            raise ValueError(f"{self.name} server flags {clash} are set by tandemrl itself")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
        cmd += ["--host", host, "--port", str(port), "--tp-size", str(strategy.tp), "--dp-size", str(strategy.dp)]
        if strategy.pp > 1:
            cmd += ["--pp-size", str(strategy.pp)]
        return cmd + cli_flags(normalized)

    def server_env(self) -> dict[str, str]:
        return {}

    def lora_flags(self, rank: int) -> dict[str, Any]:
        raise ValueError(f"lora.rank={rank}: {self.name} servers load no LoRA adapters at run time here")

    def unknown_flags(self, flags: list[str]) -> list[str]:
        """[]: SGLang (CUDA-only, not installed here) is not asked; a wrong flag is named when its server starts."""
        return []

    def cpu_launch(self, flags: dict[str, Any], child_env: dict[str, str], env: dict[str, str], world: int) -> None:
        """Nothing to adjust: SGLang servers need CUDA (they fail at start-up without it)."""


def _split_triples(
    triples: list[Any], field: str = "output_token_logprobs", first: int = 0
) -> tuple[list[int], list[float]]:
    """``[[logprob, token_id, text], ...]`` -> (token ids, logprobs); errors name ``meta_info.<field>[first + i]``."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for i, t in enumerate(triples, start=first):
        if not isinstance(t, list | tuple) or len(t) < 2:
            raise BadServerPayload(f"sglang: 'meta_info.{field}[{i}]' must be [logprob, token_id, text], got {t!r}")
        lp, tok = t[0], t[1]
        if lp is None or not isinstance(tok, int) or isinstance(tok, bool):
            raise BadServerPayload(f"sglang: 'meta_info.{field}[{i}]' has a bad entry {t!r}")
        tokens.append(tok)
        logprobs.append(float(lp))
    return tokens, logprobs
