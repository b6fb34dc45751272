"""An OpenAI request body -> the sampling parameters of the model call.

Sampling (temperature, top-p/k, min-p) stays the workflow's ``gconfig``: the trainer's
behaviour-policy logprobs and truncation replay depend on it, so an agent cannot change it.
An agent may lower the token budget (``max_tokens`` / ``max_completion_tokens``), add stop
strings (``stop``), set a ``seed``, and constrain the output (``response_format`` with a JSON
schema or ``json_object``, or vLLM's ``structured_outputs`` in the body, e.g. through the
openai client's ``extra_body``; forwarded to vLLM servers only).
"""

from __future__ import annotations

from typing import Any

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.workflows.proxy.render import BadRequest

_UNSUPPORTED = ("logit_bias", "functions", "audio", "prediction")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer, got {value!r}")
    return value


def request_gconfig(
    base: GenerationHyperparameters, body: dict[str, Any], prompt_len: int, max_context_len: int | None
) -> GenerationHyperparameters:
    """``base`` with the request's token budget and stop strings applied (one sample)."""
    for key in _UNSUPPORTED:
        if body.get(key):
            raise BadRequest(f"'{key}' is not supported by the tandemrl proxy")
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest(f"'n' must be 1 (the proxy records one sample per call), got {n!r}")
    budget = base.max_new_tokens
    for key in ("max_tokens", "max_completion_tokens"):
        asked = _positive_int(body, key)
        if asked is not None:
            budget = min(budget, asked)
    if max_context_len is not None:
        room = max_context_len - prompt_len
        if room < 1:
            raise BadRequest(
                f"the prompt has {prompt_len} tokens; the context limit is {max_context_len} (max_context_len)"
            )
        budget = min(budget, room)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r:.60}")
    stops = list(base.stop or []) + list(stop or [])
    return base.new(n_samples=1, max_new_tokens=budget, stop=stops or None)


def request_metadata(body: dict[str, Any]) -> dict[str, Any]:
    """``seed`` and the output constraint of the request, as ``ModelRequest.metadata``."""
    meta: dict[str, Any] = {}
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest(f"'seed' must be an integer, got {seed!r}")
        meta["seed"] = seed
    constraint = body.get("structured_outputs")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        if fmt["type"] == "json_object":
            constraint = {"json_object": True}
        elif fmt["type"] == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            constraint = {"json": fmt["json_schema"].get("schema", {})}
        else:
            raise BadRequest(f"'response_format' type {fmt.get('type')!r} is not supported")
    if constraint is not None:
        if not isinstance(constraint, dict) or not constraint:
            raise BadRequest(f"'structured_outputs' must be a non-empty object, got {constraint!r:.60}")
        meta["structured_outputs"] = constraint
    return meta
