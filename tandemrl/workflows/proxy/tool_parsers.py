"""Tool-call parsers: the model's raw text -> (content, OpenAI tool calls), pluggable by name.

A parser is ``fn(text) -> ParsedReply``. Register more with :func:`register_tool_parser`.
Built in: ``qwen2`` (alias ``hermes``): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format of Qwen2/2.5/3 chat templates; ``none``: never parses calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedReply:
    """``content`` is the text outside the calls (None when empty); ``failed`` counts unparsable call blocks."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0


ToolParser = Callable[[str], ParsedReply]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str, parser: ToolParser) -> None:
    _PARSERS[name] = parser


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"tool_parser: unknown parser {name!r} (known: {sorted(_PARSERS)})")
    return _PARSERS[name]


def openai_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (arguments as a JSON string, as the API sends them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


_QWEN_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_qwen2(text: str) -> ParsedReply:
    """``<tool_call>{json}</tool_call>`` blocks; a block that is not ``{"name": str, "arguments": ...}`` stays text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    failed, pos = 0, 0
    for m in _QWEN_BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
            ok = isinstance(obj, dict) and isinstance(obj.get("name"), str)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            failed += 1
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(openai_tool_call(obj["name"], obj.get("arguments", {})))
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content or None, calls, failed)


def parse_none(text: str) -> ParsedReply:
    return ParsedReply(text or None)


register_tool_parser("qwen2", parse_qwen2)
register_tool_parser("hermes", parse_qwen2)
register_tool_parser("none", parse_none)
