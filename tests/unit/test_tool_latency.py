"""The agentic benchmark's tool service (bench/agentic_env.py) over real HTTP: a slow tool call never blocks
other episodes. Order, not time: the slow call's reply is due in 600 s, and the fast episode must be handed
out (and the slow one still running) long before."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest
from test_executor import make_executor
from utils import REPO_ROOT

from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.workflows.rlvr import completion_row

sys.path.insert(0, str(REPO_ROOT / "bench"))
from agentic_env import Latency, LongTailWorkflow, ToolService, call_tool  # noqa: E402

from tandemrl.api.inference import ModelResponse  # noqa: E402


class ToolWorkflow(RolloutWorkflow):
    """One tool call with the row's expression, then a one-token trajectory whose reward is the tool's answer."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def arun_episode(self, engine: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        answer = float(await call_tool(data["expression"], url=self.url))
        resp = ModelResponse(input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.5], output_versions=[0])
        return completion_row([1, 2], resp, answer)


def test_a_slow_tool_call_never_holds_back_a_fast_episode() -> None:
    with ToolService(
        Latency("fixed", 0.0), latency_of=lambda body: 600.0 if body["expression"] == "9*9" else 0.0
    ) as tools:
        ex, _ = make_executor(k=1, bsz=1, max_conc=4)  # both episodes may run at once
        try:
            ex.submit({"expression": "9*9"}, ToolWorkflow(tools.url))  # its reply is due in 600 s
            ex.submit({"expression": "2+3"}, ToolWorkflow(tools.url))
            first = ex.wait(1, timeout=300)
            assert float(first["rewards"][0]) == 5.0  # the fast episode came back first...
            assert ex.get_stats().running == 1 and tools.served == 1  # ...while the slow call still waits
        finally:
            ex.destroy()


def test_latency_draws_are_the_stated_distribution_and_reproducible() -> None:
    lat = Latency("lognormal", median=0.5, p99=5.0, seed=3)
    rng = random.Random(3)
    draws = sorted(lat.draw(rng) for _ in range(20000))
    assert draws[10000] == pytest.approx(0.5, rel=0.05) and draws[19800] == pytest.approx(5.0, rel=0.15)
    first, second = random.Random(7), random.Random(7)
    assert [lat.draw(first) for _ in range(3)] == [lat.draw(second) for _ in range(3)]
    with pytest.raises(ValueError, match="need 0 < median < p99"):
        Latency("lognormal", median=1.0, p99=0.5)


def test_long_tail_lengths_follow_the_pareto_draw_per_prompt() -> None:
    wf = LongTailWorkflow.__new__(LongTailWorkflow)  # only the length draw is exercised
    wf.min_tokens, wf.alpha, wf._drawn = 16, 1.2, {}
    lengths = [wf.draw_tokens([7, 8, 9], cap=512) for _ in range(4000)]
    assert min(lengths) >= 16 and max(lengths) == 512  # the cap binds the tail
    # P(X > 64) = (16 / 64) ** 1.2 = 0.189 for Pareto(16, 1.2)
    assert sum(x > 64 for x in lengths) / len(lengths) == pytest.approx(0.189, abs=0.03)
    again = LongTailWorkflow.__new__(LongTailWorkflow)
    again.min_tokens, again.alpha, again._drawn = 16, 1.2, {}
    assert [again.draw_tokens([7, 8, 9], cap=512) for _ in range(50)] == lengths[:50]  # same prompt, same draws
