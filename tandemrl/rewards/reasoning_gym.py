"""The reward of a reasoning-gym row (``tandemrl.data.reasoning_gym``): its own task's verifier.

The completion's answer is the text of its last ``<answer>...</answer>`` (reasoning-gym's format, which the rows'
system prompt asks for; none: reward 0), or for a row whose ``answer_format`` is ``last_number`` and a completion
with no tag, the last number in its text (a model too small to write tags can still be scored on a numeric task);
it is handed with the row's entry to ``score_answer`` of the task named in the
entry (``metadata.source_dataset``). Scores are the task's own, in [0, 1]: some tasks give partial credit.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

ANSWER_FORMATS = ("tag", "last_number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# The answer is at the end: only the tail is searched, which bounds the work on a run-away completion.
MAX_COMPLETION_CHARS = 4000


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def entry_of(reasoning_gym: str) -> dict[str, Any]:
    """The row's reasoning-gym entry; raises one line if it is not one."""
    entry = json.loads(reasoning_gym) if isinstance(reasoning_gym, str) else reasoning_gym
    task = entry.get("metadata", {}).get("source_dataset") if isinstance(entry, dict) else None
    if not isinstance(task, str):
        raise ValueError(f"reasoning_gym: not a reasoning-gym entry (no metadata.source_dataset): {str(entry)[:80]!r}")
    return entry


def extract_answer(completion: str, answer_format: str = "tag") -> str | None:
    """The text of the completion's last ``<answer>...</answer>``, stripped; without one, for ``last_number`` the
    last number in the text (commas kept: the verifiers strip them), else None."""
    from reasoning_gym.utils import extract_answer as last_tagged

    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format: {answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
    if not isinstance(completion, str):
        return None
    tail = completion[-MAX_COMPLETION_CHARS:]
    tagged = last_tagged(tail)
    if tagged is not None or answer_format == "tag":
        return tagged
    numbers = _NUMBER.findall(tail)
    return numbers[-1].rstrip(".") if numbers else None


def score_entry(completion: str, reasoning_gym: str, answer_format: str = "tag") -> tuple[float, str | None]:
    """(score, the extracted answer) of ``completion`` for the entry, by its task's verifier."""
    entry = entry_of(reasoning_gym)
    answer = extract_answer(completion, answer_format)
    if answer is None:
        return 0.0, None
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry)), answer


def reasoning_gym_reward_fn(
    prompt: str | None,
    completions: str,
    prompt_ids: list[int] | None,
    completion_ids: list[int] | None,
    reasoning_gym: str,
    answer_format: str = "tag",
    **kwargs: Any,
) -> float:
    """The task verifier's score of the completion's answer (``extract_answer``) for this row's entry."""
    return score_entry(completions, reasoning_gym, answer_format)[0]
