"""vLLM (>= 0.32) request builder/parser: token-in/token-out over ``/inference/v1/generate``.

Server side this needs ``--enable-scale-out`` (the generate route), ``VLLM_SERVER_DEV_MODE=1``
(pause/resume, versions, ``/collective_rpc``) and the tandemrl worker extension, whose
methods ``tandemrl_update_from_disk(path)``, ``tandemrl_init_weight_group(host, port,
world_size, rank, backend, timeout)`` and ``tandemrl_recv_weights(meta_json)`` the RPC
calls below name. A collective update is one ``tandemrl_recv_weights`` call per server
listing all buckets; the trainer broadcasts them in order while that call runs.
``/collective_rpc`` forwards only JSON strings, so every kwarg is sent as a string.

Interruption: ``POST /pause?mode=abort`` makes in-flight requests return their partial
tokens with ``finish_reason "abort"``; the client resubmits the prompt plus those tokens.
``POST /pause?mode=keep&clear_cache=false`` instead freezes them in the scheduler with their
KV blocks; after ``/resume`` they go on where they stopped, and vLLM labels each token with the
weight version current at the step that produced it. Without ``clear_cache=false`` vLLM preempts
the kept requests at the pause (their KV dropped, recomputed at the resume). Every generate
request carries ``cache_salt`` = its weight version, so a request sent after an update never
matches prefix-cache blocks of an older version, even when ``/reset_prefix_cache`` cannot drop
them because a kept request still holds them.
Request metadata ``seed`` (int), ``ignore_eos`` (bool) and ``structured_outputs`` (vLLM's
constraint object, e.g. ``{"regex": ...}``) are forwarded when present.
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
from tandemrl.utils.machine import usable_cores
from tandemrl.weights.wire import buckets_to_json

if TYPE_CHECKING:
    from tandemrl.api.types import ParallelStrategy

WORKER_EXTENSION = "tandemrl.inference.vllm_ext.TandemWorkerExtension"
# The served name of the trainer's LoRA adapter: every adapter update reloads it in place.
ADAPTER_NAME = "tandemrl-policy"
# vLLM attaches /v1/load_lora_adapter only with this set; a server also needs --enable-lora.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def lora_server_flags(rank: int) -> dict[str, Any]:
    """Server flags that let a vLLM server load one adapter of ``rank`` at run time."""
    fits = [r for r in _MAX_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank} exceeds vLLM's largest --max-lora-rank {_MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


# Deterministic runs seed every request. When a prefill is split over scheduler steps (chunked prefill),
# vLLM 0.32 rewinds the request's generator with set_offset, which a CPU torch.Generator refuses: the
# server's worker dies ("CPU Generator does not use offset"). Whole prefills never rewind; on GPUs the
# flag costs only prefill batching, in deterministic runs alone.
DETERMINISTIC_SERVER_FLAGS: dict[str, Any] = {"no_enable_chunked_prefill": True}


# vLLM finish reasons -> ours; "repetition" is the model ending itself, like a stop.
_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}
# Flags server_command owns; passing them in `extra` would silently conflict.
_FIXED_FLAGS = {
    "model",
    "host",
    "port",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_scale_out",
}


class VLLMBackend(TimeoutsMixin):
    """Builds and parses vLLM HTTP calls."""

    name = "vllm"
    parallel_dims = "dtp"  # allocation_mode dims it serves with: data, tensor, pipeline
    # tandemrl_recv_weights takes every bucket's metadata in one call.
    multi_bucket_collective = True
    features = frozenset({"token", "middleware", "lora_adapters", "judge"})
    deterministic_flags = DETERMINISTIC_SERVER_FLAGS
    dtypes = ("auto", "bfloat16", "float", "float16", "float32", "half")  # vLLM 0.32's --dtype choices
    # Set once a LoRA adapter is loaded (``adapter_loaded``): generation then names it as the model.
    adapter: str | None = None

    # ---- generation ----------------------------------------------------------------------

    def build_generate(self, req: ModelRequest, output_so_far: list[int], remaining: int, version: int) -> HttpRequest:
        """vLLM labels tokens itself (see ``parse_generate``); ``version`` salts the prefix cache."""
        token_ids = check_budget(req, output_so_far, remaining, self.name)
        g = req.gconfig
        params: dict[str, Any] = {
            "n": 1,
            "max_tokens": remaining,
            "min_tokens": min_tokens_left(req, output_so_far, remaining),
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": 1.0 if g.greedy else g.top_p,
            "top_k": 0 if g.greedy or g.top_k <= 0 else g.top_k,  # 0 disables top-k in vLLM
            "min_p": 0.0 if g.greedy else g.min_p,
            "stop_token_ids": list(g.stop_token_ids),
            "frequency_penalty": g.frequency_penalty,
            "logprobs": 0,  # the sampled token's logprob only
            "detokenize": bool(g.stop),  # stop strings need text; otherwise skip the work
        }
        if g.stop:
            params["stop"] = list(g.stop)
        if req.metadata.get("seed") is not None:
            params["seed"] = int(req.metadata["seed"])
        if req.metadata.get("ignore_eos"):
            params["ignore_eos"] = True
        if req.metadata.get("structured_outputs"):  # e.g. {"regex": ...} or {"json": schema}
            params["structured_outputs"] = dict(req.metadata["structured_outputs"])
        body = {
            "request_id": req.rid,
            "token_ids": token_ids,
            "sampling_params": params,
            "stream": False,
            "cache_salt": cache_salt(version),
        }
        if self.adapter is not None:
            body["model"] = self.adapter
        return HttpRequest("POST", "/inference/v1/generate", body, self.request_timeout)

    def parse_generate(self, payload: dict[str, Any]) -> GenerateChunk:
        server_error(payload, self.name)
        choices = require_list(payload, "choices", self.name, "")
        if not choices:
            raise BadServerPayload(f"{self.name}: server reply has an empty 'choices' list")
        choice = choices[0]
        where = "choices[0]"
        tokens = int_list(require_list(choice, "token_ids", self.name, where), f"{where}.token_ids", self.name)
        reason = require(choice, "finish_reason", self.name, where)
        if reason not in _FINISH:
            raise BadServerPayload(f"{self.name}: unknown '{where}.finish_reason' {reason!r}")
        logprobs = _logprobs(choice.get("logprobs"), tokens, where)
        spans = _spans(choice.get("weight_versions"), where)
        return GenerateChunk(tokens, logprobs, _FINISH[reason], spans)

    def build_prompt_logprobs(self, token_ids: list[int], rid: str) -> HttpRequest:
        """The generate route with ``prompt_logprobs: 0`` (each prompt token's own logprob) and one
        greedy token that nobody reads. vLLM computes prompt logprobs from the raw logits, so they
        are at temperature 1 whatever the sampling parameters say."""
        ids = check_scoring_ids(token_ids, self.name)
        params = {"n": 1, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}
        body = {"request_id": rid, "token_ids": ids, "sampling_params": params, "stream": False}
        return HttpRequest("POST", "/inference/v1/generate", body, self.request_timeout)

    def parse_prompt_logprobs(self, payload: dict[str, Any], token_ids: list[int]) -> list[float]:
        server_error(payload, self.name)
        entries = require_list(payload, "prompt_logprobs", self.name, "")
        if len(entries) != len(token_ids):
            raise BadServerPayload(
                f"{self.name}: 'prompt_logprobs' has {len(entries)} entries for {len(token_ids)} prompt tokens"
            )
        out: list[float] = []
        for i in range(1, len(token_ids)):
            where = f"prompt_logprobs[{i}]"
            # JSON object keys are strings: the token id as text.
            entry = require(entries[i], str(token_ids[i]), self.name, where)
            out.append(float(require(entry, "logprob", self.name, f"{where}.{token_ids[i]}")))
        return out

    # ---- control ---------------------------------------------------------------------------

    def build_pause(self, mode: PauseMode = "abort") -> HttpRequest:
        """``keep`` sends ``clear_cache=false``: vLLM would otherwise preempt the kept requests."""
        if mode == "keep":
            return HttpRequest("POST", "/pause?mode=keep&clear_cache=false", None, self.control_timeout)
        if mode != "abort":
            raise ValueError(f"{self.name}: InferenceClientConfig.pause_mode must be 'abort' or 'keep', got {mode!r}")
        return HttpRequest("POST", "/pause?mode=abort", None, self.control_timeout)

    def build_resume(self) -> HttpRequest:
        return HttpRequest("POST", "/resume", None, self.control_timeout)

    def build_sleep(self, level: int) -> HttpRequest:
        """Dev-mode route; level 1 needs ``--enable-sleep-mode`` (a CPU worker ignores the memory part)."""
        return HttpRequest("POST", f"/sleep?level={int(level)}&mode=abort", None, self.update_timeout)

    def build_wake_up(self) -> HttpRequest:
        return HttpRequest("POST", "/wake_up", None, self.update_timeout)

    def build_health(self) -> HttpRequest:
        return HttpRequest("GET", "/health", None, self.control_timeout)

    def build_version_get(self) -> HttpRequest:
        return HttpRequest("GET", "/weight_info", None, self.control_timeout)

    def parse_version(self, payload: dict[str, Any]) -> int | None:
        server_error(payload, self.name)
        return parse_version_label(require(payload, "weight_version", self.name, ""))

    def build_set_version(self, version: int) -> HttpRequest:
        return HttpRequest("POST", "/update_weight_version", {"new_version": str(version)}, self.control_timeout)

    def build_abort_all(self) -> HttpRequest:
        """The RL route aborts every in-flight request when ``request_ids`` is empty."""
        return HttpRequest("POST", "/abort_requests", {}, self.control_timeout)

    def build_flush_cache(self) -> HttpRequest:
        return HttpRequest("POST", "/reset_prefix_cache", None, self.control_timeout)

    # ---- weight updates --------------------------------------------------------------------

    def build_update_from_disk(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        """RPC load, drop the prefix cache, then (if ``meta.version`` is set) relabel the weights."""
        if meta.type != "disk" or not meta.path:
            raise ValueError(f"{self.name}: build_update_from_disk needs a 'disk' WeightUpdateMeta with a path")
        steps = [self._rpc("tandemrl_update_from_disk", {"path": meta.path}), self.build_flush_cache()]
        if meta.version is not None:
            steps.append(self.build_set_version(meta.version))
        return steps

    def build_lora_probe(self) -> HttpRequest:
        """The dev-mode server info: its vLLM config tells whether LoRA adapters can be loaded."""
        return HttpRequest("GET", "/server_info?config_format=json", None, self.update_timeout)

    def parse_lora_probe(self, payload: dict[str, Any]) -> int:
        """``max_lora_rank`` of a server started with ``--enable-lora`` and runtime adapter loading; else 0."""
        server_error(payload, self.name)
        lora = require(payload, "vllm_config", self.name, "").get("lora_config")
        runtime = str(payload.get("vllm_env", {}).get(RUNTIME_LORA_ENV, "")).lower() in ("1", "true")
        return int(require(lora, "max_lora_rank", self.name, "vllm_config.lora_config")) if lora and runtime else 0

    def build_load_adapter(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        """(Re)load the PEFT adapter at ``meta.path`` as ``ADAPTER_NAME`` in place, drop the prefix cache,
        then (if ``meta.version`` is set) relabel the weights."""
        if meta.type != "disk" or not meta.path:
            raise ValueError(f"{self.name}: build_load_adapter needs a 'disk' WeightUpdateMeta with a path")
        body = {"lora_name": ADAPTER_NAME, "lora_path": meta.path, "load_inplace": True}
        steps = [HttpRequest("POST", "/v1/load_lora_adapter", body, self.update_timeout), self.build_flush_cache()]
        if meta.version is not None:
            steps.append(self.build_set_version(meta.version))
        return steps

    def adapter_loaded(self) -> None:
        self.adapter = ADAPTER_NAME

    def build_init_weight_group(self, meta: WeightUpdateMeta, rank_offset: int) -> HttpRequest:
        """Each worker joins as rank ``rank_offset`` + its own local rank (tp/pp index)."""
        check_collective(meta, rank_offset, self.name)
        kwargs = {
            "host": meta.group_addr,
            "port": str(meta.group_port),
            "world_size": str(meta.world_size),
            "rank": str(rank_offset),
            "backend": meta.comm_backend,  # must match the trainer's side of the group
            "timeout": str(self.update_timeout),
        }
        return self._rpc("tandemrl_init_weight_group", kwargs)

    def build_leave_weight_group(self, meta: WeightUpdateMeta) -> HttpRequest:
        return self._rpc("tandemrl_destroy_weight_group", {})

    def build_update_from_collective(self, meta: WeightUpdateMeta, buckets: list[list[ParamSpec]]) -> HttpRequest:
        """ONE RPC receiving every bucket: the extension reads the broadcasts in order inside the call.

        The metadata is the multi-bucket ``[[[name, dtype, shape], ...], ...]`` JSON of
        ``tandemrl.weights.wire``, so one update costs one HTTP round trip per server
        however many buckets it has.
        """
        if meta.type != "collective":
            raise ValueError(f"{self.name}: build_update_from_collective needs a 'collective' WeightUpdateMeta")
        check_buckets(buckets, self.name)
        kwargs = {"meta_json": buckets_to_json(buckets)}
        if meta.delta != "none":  # every bucket comes with a header broadcast (tandemrl.weights.delta)
            if not meta.delta_tag:
                raise ValueError(f"{self.name}: a delta update needs WeightUpdateMeta.delta_tag")
            kwargs.update(delta=meta.delta, tag=meta.delta_tag, base=meta.delta_base or "")
        return self._rpc("tandemrl_recv_weights", kwargs)

    def _rpc(self, method: str, kwargs: dict[str, str]) -> HttpRequest:
        body = {"method": method, "kwargs": kwargs, "timeout": self.update_timeout}
        return HttpRequest("POST", "/collective_rpc", body, self.update_timeout)

    # ---- launching -------------------------------------------------------------------------

    def server_command(
        self, model_path: str, host: str, port: int, strategy: ParallelStrategy, extra: dict[str, Any]
    ) -> list[str]:
        """One OpenAI-compatible vLLM server; ``extra`` adds/overrides flags (``{"max_model_len": 512}``)."""
        clash = sorted(k for k in extra if flag_name(k) in _FIXED_FLAGS)
        if clash:
            raise ValueError(f"{self.name} server flags {clash} are set by tandemrl itself")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
        cmd += ["--host", host, "--port", str(port)]
        cmd += ["--tensor-parallel-size", str(strategy.tp), "--pipeline-parallel-size", str(strategy.pp)]
        if strategy.dp > 1:
            cmd += ["--data-parallel-size", str(strategy.dp)]
        cmd.append("--enable-scale-out")
        defaults: dict[str, Any] = {
            "logprobs_mode": "processed_logprobs",  # behaviour logprobs after temperature/top-k/top-p
            "worker_extension_cls": WORKER_EXTENSION,
            "dtype": "auto",
            "seed": 0,
        }
        normalized = {flag_name(k): v for k, v in extra.items()}
        return cmd + cli_flags({**defaults, **normalized})

    def server_env(self) -> dict[str, str]:
        """Dev mode (RL routes) and runtime LoRA loading (used only by servers started with --enable-lora)."""
        return {"VLLM_SERVER_DEV_MODE": "1", RUNTIME_LORA_ENV: "True"}

    # ---- launching -------------------------------------------------------------------------

    def lora_flags(self, rank: int) -> dict[str, Any]:
        return lora_server_flags(rank)

    def unknown_flags(self, flags: list[str]) -> list[str]:
        """The ``flags`` (names) the installed vLLM's server does not take (``tandemrl.inference.vllm_flags``)."""
        from tandemrl.inference.vllm_flags import unknown_flags

        return unknown_flags(flags)

    def cpu_launch(self, flags: dict[str, Any], child_env: dict[str, str], env: dict[str, str], world: int) -> None:
        """vLLM's CPU build: eager mode (the compiled graph buys little for small models but costs a minute at
        start-up), a 1 GiB KV cache (the default takes a share of host RAM), and a one-device server without a
        core list runs its model in the engine process (:func:`one_process_cpu_engine`)."""
        if not any(flag_name(k) == "enforce_eager" for k in flags):
            flags["enforce_eager"] = True
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        bind = env.get(OMP_BIND, child_env.get(OMP_BIND, "auto"))
        chosen = any(flag_name(k) == "distributed_executor_backend" for k in flags)
        if world == 1 and bind in ("", "auto") and not chosen:
            one_process_cpu_engine(flags, child_env, env)


OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU: the cores a server's threads are pinned to


def one_process_cpu_engine(flags: dict[str, Any], child_env: dict[str, str], env: dict[str, str]) -> None:
    """Run a one-device CPU vLLM's model in its engine process (``uni`` executor) instead of a third process.

    vLLM on CPU otherwise spawns a worker process that imports vLLM again: ~6 s more per server start on 2 cores.
    Only for servers without a core list (``VLLM_CPU_OMP_THREADS_BIND`` unset or ``auto``): a list is pinned by the
    multiprocess executor alone. Its automatic binding takes every usable core but one, so that many OpenMP threads
    are set here before the server starts (unless ``env`` sets ``OMP_NUM_THREADS``); they are not pinned.
    """
    flags["distributed_executor_backend"] = "uni"
    child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM 0.32 turns ``uni`` back into ``mp`` without this
    if "OMP_NUM_THREADS" not in env:
        child_env["OMP_NUM_THREADS"] = str(max(1, usable_cores() - 1))


def cache_salt(version: int) -> str:
    """The prefix-cache salt of requests sent at weight ``version``: KV is shared within a version only."""
    return f"tandemrl-w{int(version)}"


def _logprobs(block: Any, tokens: list[int], where: str) -> list[float]:
    """Sampled-token logprobs from ``logprobs.content``, checked against ``token_ids``."""
    content = block.get("content") if isinstance(block, dict) else None
    if content is None:
        if not tokens:  # an abort before the first token may carry no logprobs block
            return []
        raise BadServerPayload(f"vllm: server reply is missing field '{where}.logprobs.content'")
    if not isinstance(content, list) or len(content) != len(tokens):
        got = len(content) if isinstance(content, list) else type(content).__name__
        raise BadServerPayload(f"vllm: '{where}.logprobs.content' has {got} entries for {len(tokens)} token_ids")
    out: list[float] = []
    for i, (entry, tok) in enumerate(zip(content, tokens, strict=True)):
        lp = require(entry, "logprob", "vllm", f"{where}.logprobs.content[{i}]")
        if entry.get("token_id", tok) != tok:
            raise BadServerPayload(
                f"vllm: '{where}.logprobs.content[{i}].token_id' is {entry['token_id']}, token_ids has {tok}"
            )
        out.append(float(lp))
    return out


def _spans(raw: Any, where: str) -> list[VersionSpan] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadServerPayload(f"vllm: '{where}.weight_versions' must be a list, got {type(raw).__name__}")
    spans = []
    for i, s in enumerate(raw):
        at = f"{where}.weight_versions[{i}]"
        start, end = require(s, "start", "vllm", at), require(s, "end", "vllm", at)
        spans.append(VersionSpan(parse_version_label(require(s, "version", "vllm", at)), int(start), int(end)))
    return spans
