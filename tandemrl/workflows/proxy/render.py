"""Chat messages -> prompt token ids with the tokenizer's chat template (the proxy never sends text).

OpenAI messages are normalised first (only the fields templates read; content parts joined to
text; tool-call ``arguments`` parsed from their JSON string into a dict, which is what HF
chat templates expect), so two requests carrying the same conversation compare equal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_KEEP = ("role", "content", "name", "tool_call_id", "reasoning_content")
# An assistant turn's stand-in when rendering the tokens that follow it (see ``suffix_ids``).
_PLACEHOLDER = "\u2063TANDEMRL_PROXY_TURN\u2063"


class BadRequest(ValueError):
    """A request the proxy cannot serve; its message goes back to the client as a 400."""


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are supported
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"{where}.content: only text content parts are supported, got {part!r:.60}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f"{where}: a tool call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRequest(f"{where}.function.arguments is not JSON: {e}") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The fields of each message a chat template reads, in a canonical form."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"{where} must be an object with a 'role'")
        m = {k: msg[k] for k in _KEEP if msg.get(k) is not None}
        m["content"] = _text(msg.get("content"), where) or ""
        calls = msg.get("tool_calls")
        if calls:
            m["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(m)
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal up to tool-call ids (the agent may renumber them)."""

    def key(m: dict[str, Any]) -> Any:
        calls = [c["function"] for c in m.get("tool_calls", [])]
        return ({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}, calls)

    return key(a) == key(b)


class ChatRenderer:
    """Renders normalised messages (and tools) with a chat template into token ids."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, enable_thinking: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.enable_thinking = enable_thinking
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def text(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"enable_thinking": self.enable_thinking}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as e:  # jinja errors: the conversation does not fit the template
            raise BadRequest(f"chat template failed on these messages: {type(e).__name__}: {e}") from None

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The whole conversation rendered, ending with the assistant header."""
        return self.ids(self.text(messages, tools, True))

    def suffix_ids(
        self, last_output: Sequence[int], new: Sequence[dict[str, Any]], tools: list[dict] | None
    ) -> list[int]:
        """Tokens that follow an assistant turn whose tokens were ``last_output``: the template's end of
        that turn (minus the end-of-turn token if the model emitted it), ``new`` messages, the assistant header.

        Rendered after a stand-in assistant turn, so how the template re-renders earlier turns cannot
        leak in. Raises ``BadRequest`` if the template drops the stand-in's content.
        """
        anchor = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _PLACEHOLDER}]
        full = self.text(anchor + list(new), tools, True)
        at = full.rfind(_PLACEHOLDER)
        if at < 0:
            raise BadRequest("the chat template drops assistant content; the proxy cannot render appended turns")
        text = full[at + len(_PLACEHOLDER) :]
        if last_output and last_output[-1] in self._special:
            own = self.tokenizer.decode([last_output[-1]], skip_special_tokens=False)
            if own and text.startswith(own):
                text = text[len(own) :]
        return self.ids(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
