"""GSM8K correctness reward: 1.0 if the completion's final answer equals the reference, else 0.0.

Model output is untrusted: nothing from it is evaluated as code, and nothing that can
describe a huge computation reaches the math parser. The final answer is located with
plain string/regex code (``#### x``, else the last ``\\boxed{x}``, else the last number in
the text), reduced to a plain number or a short fraction-only LaTeX snippet (no powers,
factorials or binomials: ``\\boxed{9^{9^{9^9}}}`` would otherwise keep a CPU busy for
ever), and only then parsed and compared by math-verify's LaTeX parser. math-verify's
plain-expression extractor is never used: it hands text to sympy's ``parse_expr``,
which calls ``eval``.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

_HASHES = "####"
# A number as written in prose: sign, thousands separators, decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+")
# A boxed answer simple enough to hand to the LaTeX parser: numbers, + - / ( ), and
# \frac-style fractions only. Anything else falls back to the number it contains.
_SAFE_LATEX = re.compile(r"(?:[\d\s.+\-/()]|\\[dt]?frac|[{}])+")
_MAX_SNIPPET = 64
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
# Only the tail of a completion is searched: the final answer is at the end, and this
# bounds the work spent on pathological (e.g. endlessly repeating) outputs.
MAX_COMPLETION_CHARS = 4000
# Seconds math-verify may spend per parse/compare; it uses signal.alarm, main thread only.
_MATH_VERIFY_TIMEOUT = 5


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return m.group(0).replace(",", "") if m else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_reference_answer(answer: str) -> str:
    """The number after the last ``####`` of a GSM8K reference solution, commas removed."""
    if not isinstance(answer, str) or _HASHES not in answer:
        raise ValueError(f"gsm8k reference 'answer' has no '####' final answer: {str(answer)[-80:]!r}")
    number = _first_number(answer.rsplit(_HASHES, 1)[1])
    if number is None:
        raise ValueError(f"gsm8k reference 'answer' has no number after '####': {answer[-80:]!r}")
    return number


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1 for opener in _BOX_OPENERS)
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # unbalanced: no usable box


def _clean(snippet: str) -> str:
    """Drop units/currency/percent decorations and thousands separators around a number."""
    snippet = re.sub(r"\\[$%,!;: ]|\\text\{[^{}]*\}|[$%]", " ", snippet)
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", snippet).strip()


def extract_final_answer(completion: str) -> str | None:
    """The completion's final answer as a parser-safe LaTeX snippet (no ``$``), or None."""
    tail = completion[-MAX_COMPLETION_CHARS:]
    if _HASHES in tail:
        return _first_number(tail.rsplit(_HASHES, 1)[1])
    boxed = _last_boxed(tail)
    if boxed is not None:
        snippet = _clean(boxed)
        if snippet and len(snippet) <= _MAX_SNIPPET and _SAFE_LATEX.fullmatch(snippet) and re.search(r"\d", snippet):
            return snippet
        return _last_number(snippet)
    return _last_number(tail)


class _DropTimeoutDisabled(logging.Filter):
    """math-verify warns once per process when called without a timeout, which _timeout() does on purpose
    in worker threads: every reward worker would print the same two lines into the trainer log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabled())


def _timeout() -> int | None:
    # Off the main thread (e.g. RewardRunner's pool) signals are unavailable; the runner's
    # own timeout bounds the call there, and the snippets above are cheap to parse anyway.
    return _MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None


def _parse(snippet: str) -> list[Any]:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"${snippet}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> tuple[Any, ...]:
    parsed = _parse(extract_reference_answer(answer))
    if not parsed:
        raise ValueError(f"gsm8k reference 'answer' could not be parsed: {answer[-80:]!r}")
    return tuple(parsed)


def gsm8k_reward_fn(
    prompt: str | None,
    completions: str,
    prompt_ids: list[int] | None,
    completion_ids: list[int] | None,
    answer: str,
    **kwargs: Any,
) -> float:
    """1.0 if the completion's final answer equals the reference ``answer``'s, else 0.0."""
    from math_verify import verify

    if not isinstance(answer, str):
        raise TypeError(f"gsm8k reward: 'answer' must be a string, got {type(answer).__name__}")
    gold = list(_gold(answer))
    if not isinstance(completions, str) or not completions:
        return 0.0
    snippet = extract_final_answer(completions)
    if snippet is None:
        return 0.0
    pred = _parse(snippet)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=_timeout()) else 0.0
