"""GSM8K accuracy of whatever an inference client serves: greedy answers, the training reward, a Wilson interval.

``evaluate_gsm8k(client_or_url, tokenizer, rows)`` sends one greedy request per row (all in
flight at once, or ``concurrency`` at a time), decodes each completion as the RLVR workflow
does, and scores it with the GSM8K training reward (``tandemrl.rewards.gsm8k``), or a reasoning-gym row
with its task's verifier (``tandemrl.rewards.reasoning_gym``). Rows are
those of ``tandemrl.data.gsm8k.get_gsm8k_rl_dataset`` (``id``, ``messages``, ``answer``); the
prompt is built as in training (``chat_prompt_ids``), or is the bare question with
``chat_template=False``. A running trainer passes its own client; a script passes a server's
``host:port`` or URL. ``python -m tandemrl.eval`` is the command-line front end.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.inference import ModelRequest
from tandemrl.api.workflow import GenerationClient
from tandemrl.rewards.gsm8k import extract_final_answer, extract_reference_answer, gsm8k_reward_fn
from tandemrl.rewards.reasoning_gym import entry_of, score_entry
from tandemrl.workflows.rlvr import chat_prompt_ids

if TYPE_CHECKING:
    from tandemrl.inference.remote import RemoteInferenceClient

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal
INTERVAL_METHOD = "Wilson score interval, 95%"


@dataclass
class QuestionResult:
    """One scored question: its row index in the split, the completion and both answers."""

    index: int
    generated: str
    extracted: str | None  # the completion's final answer as the reward reads it; None if it has none
    gold: str
    correct: bool
    task: str | None = None  # a reasoning-gym row's task; None for GSM8K rows


@dataclass
class EvalResult:
    """Accuracy over ``questions`` with its 95% Wilson score interval."""

    n: int
    correct: int
    accuracy: float
    interval_low: float
    interval_high: float
    max_new_tokens: int
    chat_template: bool
    seconds: float
    questions: list[QuestionResult] = field(default_factory=list)
    interval_method: str = INTERVAL_METHOD

    @property
    def indices(self) -> list[int]:
        return [q.index for q in self.questions]

    def by_task(self) -> dict[str, tuple[int, int]]:
        """(correct, n) per task of a reasoning-gym mix, in order of first appearance; empty for GSM8K rows."""
        out: dict[str, tuple[int, int]] = {}
        for q in self.questions:
            if q.task is not None:
                right, n = out.get(q.task, (0, 0))
                out[q.task] = (right + q.correct, n + 1)
        return out

    def tasks_line(self) -> str:
        """``chain_sum 42/256, gcd 7/244``; empty for GSM8K rows."""
        return ", ".join(f"{task} {right}/{n}" for task, (right, n) in self.by_task().items())

    def summary(self) -> str:
        """``accuracy 0.1234 (24/200), 95% Wilson score interval [0.0812, 0.1776]``."""
        return (
            f"accuracy {self.accuracy:.4f} ({self.correct}/{self.n}), "
            f"95% Wilson score interval [{self.interval_low:.4f}, {self.interval_high:.4f}]"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["indices"] = self.indices
        out["by_task"] = {task: {"correct": r, "n": n} for task, (r, n) in self.by_task().items()}
        return out


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``correct / n`` (default: 95%)."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: need 0 <= correct <= n and n > 0, got correct={correct}, n={n}")
    p = correct / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if correct == 0 else max(0.0, center - half)  # exact ends: rounding leaves ~1e-18 there
    high = 1.0 if correct == n else min(1.0, center + half)
    return low, high


@dataclass(frozen=True)
class PairedChange:
    """How the same questions moved between two scorings: gained, lost, and McNemar's exact p."""

    gained: int  # wrong before, right after
    lost: int  # right before, wrong after
    p_value: float  # two-sided exact McNemar test (a binomial test on the discordant pairs)

    def line(self) -> str:
        return f"+{self.gained} / -{self.lost} questions, exact McNemar p={self.p_value:.3g}"


def paired_change(before: EvalResult, after: EvalResult) -> PairedChange:
    """Compare two scorings of the same questions (matched by row index)."""
    was = {q.index: q.correct for q in before.questions}
    now = {q.index: q.correct for q in after.questions}
    if was.keys() != now.keys():
        raise ValueError(f"paired_change: the scorings cover different questions ({len(was)} vs {len(now)})")
    gained = sum(1 for i, ok in now.items() if ok and not was[i])
    lost = sum(1 for i, ok in now.items() if was[i] and not ok)
    return PairedChange(gained, lost, mcnemar_exact_p(gained, lost))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs (1.0 when there are none)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def score_completion(
    index: int, completion: str, answer: str, reasoning_gym: str | None = None, answer_format: str = "tag"
) -> QuestionResult:
    """Score one completion with the training reward: against a GSM8K reference ``answer``, or for a reasoning-gym
    row (its ``reasoning_gym`` entry) by its task's verifier, correct at full score."""
    if reasoning_gym:
        score, extracted = score_entry(completion, reasoning_gym, answer_format)
        task = entry_of(reasoning_gym)["metadata"]["source_dataset"]
        return QuestionResult(index, completion, extracted, answer, correct=score == 1.0, task=task)
    reward = gsm8k_reward_fn(None, completion, None, None, answer=answer)
    return QuestionResult(
        index=index,
        generated=completion,
        extracted=extract_final_answer(completion),
        gold=extract_reference_answer(answer),
        correct=reward == 1.0,
    )


def summarize(questions: list[QuestionResult], max_new_tokens: int, chat_template: bool, seconds: float) -> EvalResult:
    """Accuracy and its interval over scored ``questions``."""
    n = len(questions)
    correct = sum(q.correct for q in questions)
    low, high = wilson_interval(correct, n)
    return EvalResult(n, correct, correct / n, low, high, max_new_tokens, chat_template, seconds, questions)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer: Any, row: dict[str, Any], chat_template: bool) -> list[int]:
    """The training prompt of ``row`` (chat template), or its bare ``question`` text."""
    if chat_template:
        return chat_prompt_ids(tokenizer, row["messages"])
    return list(tokenizer(row["question"])["input_ids"])


def connect(url: str, request_timeout: float = 3600.0) -> RemoteInferenceClient:
    """A vLLM client of the running server at ``url`` (``host:port`` or ``http://host:port``), healthy."""
    from tandemrl.configs.rollout import InferenceClientConfig
    from tandemrl.inference.remote import RemoteInferenceClient

    addr = url.split("://", 1)[-1].rstrip("/")
    client = RemoteInferenceClient.for_backend(
        "vllm", InferenceClientConfig(request_timeout=request_timeout, setup_timeout=60.0)
    )
    client.initialize([addr])
    return client


@dataclass(frozen=True)
class EvalOptions:
    """Generation budget, prompt format (None: the chat template if the tokenizer has one) and
    requests in flight at once (None: all)."""

    max_new_tokens: int = 256
    chat_template: bool | None = None
    concurrency: int | None = None


async def aevaluate_gsm8k(
    client: GenerationClient, tokenizer: Any, rows: Sequence[dict[str, Any]], options: EvalOptions
) -> EvalResult:
    """``evaluate_gsm8k`` on the caller's event loop, with a client (see the module docstring)."""
    if not rows:
        raise ValueError("evaluate_gsm8k: no rows to score")
    max_new_tokens, chat_template = options.max_new_tokens, options.chat_template
    if chat_template is None:
        chat_template = has_chat_template(tokenizer)
    elif chat_template and not has_chat_template(tokenizer):
        raise ValueError("evaluate_gsm8k: chat_template=True but the tokenizer has no chat template")
    gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=True)
    gate = asyncio.Semaphore(options.concurrency or len(rows))
    start = time.perf_counter()

    async def generate(row: dict[str, Any]) -> str:
        req = ModelRequest(input_ids=prompt_ids(tokenizer, row, chat_template), gconfig=gconfig, tokenizer=tokenizer)
        async with gate:
            resp = await client.agenerate(req)
        return tokenizer.decode(resp.output_tokens, skip_special_tokens=True)

    completions = await asyncio.gather(*(generate(row) for row in rows))
    questions = [
        score_completion(int(row["id"]), text, row["answer"], row.get("reasoning_gym"), row.get("answer_format", "tag"))
        for row, text in zip(rows, completions, strict=True)
    ]
    return summarize(questions, max_new_tokens, chat_template, time.perf_counter() - start)


def evaluate_gsm8k(
    client_or_url: GenerationClient | str,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_new_tokens: int = 256,
    chat_template: bool | None = None,
    concurrency: int | None = None,
) -> EvalResult:
    """Greedy GSM8K accuracy of the model behind ``client_or_url`` on ``rows``; blocks until done.

    ``chat_template`` None uses the tokenizer's template when it has one. Call it from a thread
    without a running event loop (use ``aevaluate_gsm8k`` inside one).
    """
    options = EvalOptions(max_new_tokens, chat_template, concurrency)
    if not isinstance(client_or_url, str):
        return asyncio.run(aevaluate_gsm8k(client_or_url, tokenizer, rows, options))
    client = connect(client_or_url)
    try:
        return asyncio.run(aevaluate_gsm8k(client, tokenizer, rows, options))
    finally:
        client.destroy()
