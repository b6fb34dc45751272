"""OpenAI response bodies: chat completions and completions, whole or as server-sent-event chunks.

The generation itself is not token-streamed: a streaming request gets the whole reply as one
delta once the call ends (then the finish chunk, usage if asked, and ``[DONE]``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tandemrl.workflows.proxy.tool_parsers import ParsedReply

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "tool_calls": "tool_calls"}


def finish_reason(stop_reason: str, parsed: ParsedReply | None) -> str:
    if parsed is not None and parsed.tool_calls:
        return "tool_calls"
    return _FINISH.get(stop_reason, "stop")


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def assistant_message(parsed: ParsedReply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    return msg


def _envelope(kind: str, model: str) -> dict[str, Any]:
    prefix = "chatcmpl-" if kind == "chat.completion" else "cmpl-"
    return {"id": prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()), "model": model}


def chat_body(model: str, parsed: ParsedReply, finish: str, n_prompt: int, n_out: int) -> dict[str, Any]:
    body = _envelope("chat.completion", model)
    body["choices"] = [{"index": 0, "message": assistant_message(parsed), "finish_reason": finish, "logprobs": None}]
    body["usage"] = usage(n_prompt, n_out)
    return body


def completion_body(model: str, text: str, finish: str, n_prompt: int, n_out: int) -> dict[str, Any]:
    body = _envelope("text_completion", model)
    body["choices"] = [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]
    body["usage"] = usage(n_prompt, n_out)
    return body


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def chat_chunks(
    model: str, parsed: ParsedReply, finish: str, n_prompt: int, n_out: int, with_usage: bool
) -> list[bytes]:
    """``chat.completion.chunk`` events: role, content, tool calls, finish, usage (if asked), ``[DONE]``."""
    base = _envelope("chat.completion.chunk", model)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    out = [chunk({"role": "assistant", "content": ""})]
    if parsed.content:
        out.append(chunk({"content": parsed.content}))
    for i, call in enumerate(parsed.tool_calls):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, finish))
    if with_usage:
        out.append(sse({**base, "choices": [], "usage": usage(n_prompt, n_out)}))
    out.append(sse("[DONE]"))
    return out


def completion_chunks(model: str, text: str, finish: str, n_prompt: int, n_out: int, with_usage: bool) -> list[bytes]:
    base = _envelope("text_completion", model)
    out = [sse({**base, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]})]
    out.append(sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}]}))
    if with_usage:
        out.append(sse({**base, "choices": [], "usage": usage(n_prompt, n_out)}))
    out.append(sse("[DONE]"))
    return out


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
