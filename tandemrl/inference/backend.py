"""Helpers every inference backend shares: payload checks, collective checks, CLI flags, timeouts.

The protocol itself (``InferenceBackend``) lives in ``tandemrl.api.backend``.

A backend never opens a socket. The shared client (``tandemrl/inference/http.py``) sends
the ``HttpRequest`` objects a backend builds and hands the decoded JSON back to it, so
retries, failover and interruption handling are written once for every server kind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from tandemrl.api.inference import ModelRequest, ParamSpec, WeightUpdateMeta

if TYPE_CHECKING:
    from tandemrl.configs.rollout import InferenceClientConfig

_B = TypeVar("_B", bound="TimeoutsMixin")


class BadServerPayload(ValueError):
    """A server reply lacks a field or has the wrong shape; the message names both."""


def require(payload: Any, key: str, backend: str, where: str) -> Any:
    """``payload[key]``, or a one-line BadServerPayload naming ``where.key`` and ``backend``."""
    if not isinstance(payload, dict):
        raise BadServerPayload(
            f"{backend}: expected a JSON object at '{where or '<reply>'}', got {type(payload).__name__}"
        )
    if key not in payload or payload[key] is None:
        raise BadServerPayload(f"{backend}: server reply is missing field '{_join(where, key)}'")
    return payload[key]


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def require_list(payload: Any, key: str, backend: str, where: str) -> list[Any]:
    value = require(payload, key, backend, where)
    if not isinstance(value, list):
        raise BadServerPayload(f"{backend}: field '{_join(where, key)}' must be a list, got {type(value).__name__}")
    return value


def server_error(payload: Any, backend: str) -> None:
    """Raise if the reply is an error object (the shape both servers use for failures)."""
    if isinstance(payload, dict) and "error" in payload and payload["error"]:
        err = payload["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        first_line = str(msg).strip().splitlines()[0] if str(msg).strip() else "(empty)"
        raise BadServerPayload(f"{backend}: server returned an error: {first_line[:300]}")


def int_list(values: list[Any], field: str, backend: str) -> list[int]:
    """``values`` after checking every entry is an integer token id."""
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadServerPayload(f"{backend}: '{field}' holds a non-integer token {v!r}")
    return list(values)


def check_collective(meta: WeightUpdateMeta, rank_offset: int, backend: str) -> None:
    """A collective meta, and a server rank offset inside its group (rank 0 is the trainer)."""
    if meta.type != "collective":
        raise ValueError(f"{backend}: build_init_weight_group needs a 'collective' WeightUpdateMeta")
    if not 1 <= rank_offset < meta.world_size:
        raise ValueError(
            f"{backend}: rank_offset {rank_offset} must be in 1..{meta.world_size - 1} (rank 0 is the trainer head)"
        )


def check_buckets(buckets: list[list[ParamSpec]], backend: str, max_buckets: int | None = None) -> None:
    """A non-empty list of non-empty buckets (at most ``max_buckets``); one-line errors."""
    if not buckets or not all(buckets):
        raise ValueError(f"{backend}: build_update_from_collective needs non-empty buckets of param_specs")
    if max_buckets is not None and len(buckets) > max_buckets:
        raise ValueError(
            f"{backend}: build_update_from_collective takes at most {max_buckets} bucket(s) per request, "
            f"got {len(buckets)}"
        )


def parse_version_label(label: Any) -> int | None:
    """Integer weight version from a server label ("3" or 3); None for e.g. "default"."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label.strip())
    return None


def check_budget(req: ModelRequest, output_so_far: list[int], remaining: int, backend: str) -> list[int]:
    """The prompt to send (prompt + output so far) after checking the token budget."""
    if remaining < 1:
        raise ValueError(f"{backend}: 'remaining' token budget must be >= 1, got {remaining} (request {req.rid})")
    if not req.input_ids:
        raise ValueError(f"{backend}: request {req.rid} has empty input_ids")
    return list(req.input_ids) + list(output_so_far)


def check_scoring_ids(token_ids: list[int], backend: str) -> list[int]:
    """Token ids to score with ``build_prompt_logprobs``: at least two (the first has no logprob), all ints."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError(f"{backend}: build_prompt_logprobs needs at least 2 token ids, got {len(ids)}")
    for v in ids:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{backend}: build_prompt_logprobs got a bad token id {v!r}")
    return ids


def min_tokens_left(req: ModelRequest, output_so_far: list[int], remaining: int) -> int:
    """Tokens still owed to ``min_new_tokens``, capped by the budget of this call."""
    return max(0, min(req.gconfig.min_new_tokens - len(output_so_far), remaining))


def flag_name(flag: str) -> str:
    """A server flag as the configs write it: ``--max-num-seqs`` / ``max-num-seqs`` -> ``max_num_seqs``."""
    return flag.lstrip("-").replace("-", "_")


def dtype_problem(backend: Any, name: str, dtype: str) -> str | None:
    """Why ``name`` servers (``backend``: the class or an instance) cannot start in ``dtype``, or None."""
    if dtype in backend.dtypes:
        return None
    return f"{name} servers take one of {', '.join(backend.dtypes)}, got {dtype!r}"


def cli_flags(extra: dict[str, Any]) -> list[str]:
    """``{"max_model_len": 512, "enforce_eager": True}`` -> ``["--max-model-len", "512", "--enforce-eager"]``.

    False/None values are dropped; lists repeat the value after one flag; a mapping is one JSON value
    (``{"hf_overrides": {"head_dtype": "float32"}}`` -> ``["--hf-overrides", '{"head_dtype": "float32"}']``).
    """
    out: list[str] = []
    for key, value in extra.items():
        if value is None or value is False:
            continue
        flag = "--" + key.lstrip("-").replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(dict(value))]
        else:
            out += [flag, str(value)]
    return out


class TimeoutsMixin:
    """Per-kind HTTP timeouts shared by the concrete backends."""

    def __init__(self, request_timeout: float = 3600.0, control_timeout: float = 60.0, update_timeout: float = 600.0):
        for label, value in (
            ("request_timeout", request_timeout),
            ("control_timeout", control_timeout),
            ("update_timeout", update_timeout),
        ):
            if value <= 0:
                raise ValueError(f"{label} must be positive, got {value}")
        self.request_timeout = request_timeout  # one generate call
        self.control_timeout = control_timeout  # pause/resume/health/version/abort
        self.update_timeout = update_timeout  # weight loading and collective receive

    @classmethod
    def from_config(cls: type[_B], config: InferenceClientConfig) -> _B:
        """Timeouts from the client config (generate and update share ``request_timeout``)."""
        return cls(request_timeout=config.request_timeout, update_timeout=config.request_timeout)
