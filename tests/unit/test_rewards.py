"""GSM8K reward on real GSM8K answers, and RewardRunner's failure handling."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tandemrl.rewards import gsm8k as gsm8k_module
from tandemrl.rewards.gsm8k import extract_reference_answer, gsm8k_reward_fn
from tandemrl.rewards.runner import RewardRunner
from tandemrl.utils import stats_tracker


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir: str) -> list[dict[str, str]]:
    rows = []
    with open(Path(gsm8k_dir) / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
    # 20 rows, plus 6 whose final answer has a thousands separator
    picked = rows[:20] + [r for r in rows if "," in r["answer"].rsplit("####", 1)[1]][:6]
    assert any("," in r["answer"].rsplit("####", 1)[1] for r in picked)
    return picked


def reward(completion: str, answer: str) -> float:
    return gsm8k_reward_fn("prompt", completion, [1], [2], answer=answer, question="q")


def test_reference_solutions_are_correct_and_perturbed_ones_are_not(gsm8k_rows: list[dict[str, str]]) -> None:
    for row in gsm8k_rows:
        answer = row["answer"]
        gold = extract_reference_answer(answer)
        assert "," not in gold and float(gold) == float(answer.rsplit("####", 1)[1].replace(",", ""))
        value = int(gold)
        body = answer.rsplit("####", 1)[0]
        assert reward(answer, answer) == 1.0
        assert reward(f"{body}#### {value + 1}", answer) == 0.0
        assert reward(f"{body}#### {value:,}<|im_end|>", answer) == 1.0  # separators, trailing eos text
        assert reward(f"So the total is $\\boxed{{{value}}}$.", answer) == 1.0
        assert reward(f"So the total is \\boxed{{{value - 1}}}.", answer) == 0.0
        assert reward(f"We get {value + 3} - 3 = {value} dollars.", answer) == 1.0  # last number
        assert reward(f"The answer is {value}.0", answer) == 1.0
        assert reward(f"#### {value}\nHmm, or maybe {value + 2}?", answer) == 1.0  # '####' wins


GARBAGE = [
    "",
    "####",
    "#### forty-two",
    "I don't know.",
    "\\boxed{",
    "\\boxed{}",
    "\\boxed{\\frac{1}{0}}",
    "9**9**9**9",
    "__import__('os').system('echo pwned')",
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{100000!}",
    "\\boxed{\\binom{100000}{50000}}",
    "1e999999",
    "9" * 6000,
    "\u0000\ufffd\U0001f600 ####\u00a0",
    "x" * 200000,
]

# What may reach math-verify's parser (module docstring of tandemrl.rewards.gsm8k): a plain number,
# or a short snippet of digits, + - / ( ) and fractions: nothing that can describe a huge computation.
PLAIN_NUMBER = re.compile(r"-?\d*\.?\d+")
FRACTION_ONLY = re.compile(r"(?:\\[dt]?frac|[\d\s.+\-/(){}])+")


@pytest.mark.timeout(120)  # a hang guard only: the speed of scoring garbage is measured in bench/reward_garbage.py
@pytest.mark.parametrize("completion", GARBAGE)
def test_garbage_completions_score_zero_and_reach_the_parser_only_as_safe_snippets(
    completion: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    real_parse = gsm8k_module._parse

    def checked_parse(snippet: str) -> list[Any]:  # checked before it reaches the parser
        parsed.append(snippet)
        assert PLAIN_NUMBER.fullmatch(snippet) or (len(snippet) <= 64 and FRACTION_ONLY.fullmatch(snippet)), snippet
        return real_parse(snippet)

    monkeypatch.setattr(gsm8k_module, "_parse", checked_parse)
    gsm8k_module._gold.cache_clear()
    assert reward(completion, "Some work.\n#### 72") == 0.0
    assert parsed[0] == "72"  # the reference, parsed through the same check


def test_reference_formats() -> None:
    assert extract_reference_answer("a\n#### 1,080") == "1080"
    assert extract_reference_answer("#### -5") == "-5"
    assert extract_reference_answer("x #### 3 #### 4.5") == "4.5"
    assert reward("it is 1080", "x #### 1,080") == 1.0
    assert reward("\\boxed{\\frac{144}{2}}", "#### 72") == 1.0
    assert reward("\\boxed{72 \\text{ apples}}", "#### 72") == 1.0
    assert reward("\\boxed{\\$72.00}", "#### 72") == 1.0
    assert reward("\\boxed{25\\%}", "#### 25") == 1.0
    with pytest.raises(ValueError, match="'answer' has no '####'"):
        reward("72", "the answer is 72")
    with pytest.raises(ValueError, match="no number after '####'"):
        reward("72", "#### seventy-two")
    with pytest.raises(TypeError, match="'answer' must be a string"):
        reward("72", None)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- runner
def _raises(**kw: Any) -> float:
    raise ZeroDivisionError("bad reward")


class Hang:
    """A reward function that blocks until ``release`` is set; ``returned`` says whether it ever returned,
    ``threads`` names the threads it ran on."""

    def __init__(self) -> None:
        self.release, self.returned = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self, **kw: Any) -> float:
        self.threads.append(threading.current_thread().name)
        self.release.wait(60)
        self.returned.set()
        return 1.0


def _returns(value: Any) -> Any:
    def fn(**kw: Any) -> Any:
        return value

    return fn


async def _async_reward(**kw: Any) -> float:
    await asyncio.sleep(0)
    return 0.25


def _failures(scope: str) -> tuple[float, float]:
    out = stats_tracker.get(scope).export()
    return out.get(f"{scope}/reward_failed", math.nan), out.get(f"{scope}/reward_failed__count", 0.0)


def test_runner_gives_no_reward_for_exceptions_counted_and_logged_once_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def flaky(completions: str, **kw: Any) -> Any:
        if completions in ("1", "3"):
            raise ZeroDivisionError("bad reward")
        return "oops" if completions == "4" else 0.5

    runner = RewardRunner(flaky, timeout=5, stat_scope="test-rewards-raise")
    with caplog.at_level("WARNING", logger="tandemrl.rewards.runner"):
        values = asyncio.run(_gather(runner, 6))
    assert values == [0.5, None, 0.5, None, None, 0.5]  # None: no reward, never a silent 0.0
    assert runner.n_errors == 3 and runner.n_timeouts == 0
    assert runner.failures == {"raised ZeroDivisionError": 2, "returned str": 1}
    assert _failures("test-rewards-raise") == (0.5, 6.0)  # the failed fraction of all calls
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines  # one line per kind
    # The calls run on several threads: which kind fails first (and is logged first) is free.
    raised = [line for line in lines if "raised ZeroDivisionError: bad reward; its group is dropped" in line]
    junk = [line for line in lines if "returned str, expected a number" in line]
    assert len(raised) == 1 and len(junk) == 1, lines
    runner.shutdown()


def test_runner_times_out_hanging_functions_and_keeps_serving() -> None:
    hang = Hang()
    runner = RewardRunner(hang, timeout=0.1, max_workers=1, stat_scope="test-rewards-timeout")
    try:
        assert asyncio.run(runner(prompt="p")) is None
        assert not hang.returned.is_set()  # the timeout ended the call, not the function returning
        assert runner.n_timeouts == 1 and runner._pool.n_abandoned == 1
        # the single worker is stuck in the abandoned call; a replacement serves the next one
        served_on: list[str] = []

        def ok_fn(**kw: Any) -> float:
            served_on.append(threading.current_thread().name)
            return 1.0

        ok = RewardRunner(ok_fn, timeout=30, max_workers=1)
        ok._pool = runner._pool  # share the pool whose only worker is stuck
        assert asyncio.run(ok(prompt="p")) == 1.0
        assert not hang.returned.is_set() and served_on != hang.threads  # served while the first still hangs
    finally:
        hang.release.set()
    assert _failures("test-rewards-timeout") == (1.0, 1.0)


def test_overlapping_sync_rewards_run_at_once_and_sequential_ones_share_a_thread() -> None:
    """A latency-bound sync reward (waiting on a remote check) is not capped at a few threads: 16 calls
    that only return once all 16 are inside run together. Calls that never overlap start one thread."""
    barrier = threading.Barrier(16, timeout=60)
    threads: set[str] = set()

    def waits_for_all(**kw: Any) -> float:
        threads.add(threading.current_thread().name)
        barrier.wait()  # BrokenBarrierError (no reward) unless 16 calls are in flight together
        return 1.0

    runner = RewardRunner(waits_for_all, timeout=120)
    assert asyncio.run(_gather(runner, 16)) == [1.0] * 16 and len(threads) == 16
    runner.shutdown()
    one = RewardRunner(_returns(0.5), timeout=30)
    for _ in range(5):
        assert asyncio.run(one(prompt="p")) == 0.5
    assert one._pool._workers == 1
    one.shutdown()


@pytest.mark.parametrize("value", [None, "1.0", math.nan, math.inf, [1.0]])
def test_runner_rejects_non_numeric_rewards(value: Any) -> None:
    runner = RewardRunner(_returns(value), timeout=5)
    assert asyncio.run(runner(prompt="p")) is None
    assert runner.n_errors == 1


def test_runner_accepts_numbers_bools_and_async_functions() -> None:
    assert asyncio.run(RewardRunner(_returns(True))(prompt="p")) == 1.0
    assert asyncio.run(RewardRunner(_returns(3))(prompt="p")) == 3.0
    async_runner = RewardRunner(_async_reward, timeout=5, stat_scope="test-rewards-async")
    assert asyncio.run(async_runner(prompt="p")) == 0.25
    assert _failures("test-rewards-async") == (0.0, 1.0)


def test_gsm8k_reward_runs_in_the_runner_thread_pool() -> None:
    """Off the main thread math-verify cannot use signals; the reward must still work."""
    runner = RewardRunner(gsm8k_reward_fn, timeout=10)
    kw = {"prompt": "p", "prompt_ids": [1], "completion_ids": [2], "answer": "#### 72"}
    assert asyncio.run(runner(completions="#### 72", **kw)) == 1.0
    assert asyncio.run(runner(completions="#### 71", **kw)) == 0.0
    assert runner.n_errors == 0 and runner.n_timeouts == 0


def test_no_timeout_warning_from_reward_threads(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads call math-verify without a timeout on purpose; its once-per-process warning is dropped."""
    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    runner = RewardRunner(gsm8k_reward_fn, timeout=10)
    with caplog.at_level("WARNING"):
        assert (
            asyncio.run(
                runner(prompt="p", prompt_ids=[1], completion_ids=[2], completions="\\boxed{3/4}", answer="#### 0.75")
            )
            == 1.0
        )
    assert math_verify.parser.TIMEOUT_WARNING_SHOWN and math_verify.grader.TIMEOUT_WARNING_SHOWN  # it did warn
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]


async def _gather(runner: RewardRunner, n: int) -> list[float]:
    return list(await asyncio.gather(*[runner(prompt="p", completions=str(i)) for i in range(n)]))
