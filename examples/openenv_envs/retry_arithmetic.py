"""An OpenEnv environment with two tries: an arithmetic question, and a second chance after a wrong answer.

Written against openenv 0.10 as any OpenEnv environment is (an ``Environment``, its ``Action`` and
``Observation``, an app from ``create_app``); tandemrl runs it unmodified (examples/openenv_grpo.yaml). A reset
with a seed draws one question; a right first answer earns 1.0, a right second answer 0.5, anything else 0.
Run it alone with ``uvicorn retry_arithmetic:app`` from this directory.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TRIES = 2
_NUMBER = re.compile(r"-?\d+")


class ArithmeticAction(Action):
    message: str = Field(..., description="The model's reply; its last integer is the answer")


class ArithmeticObservation(Observation):
    prompt: str = Field(default="", description="What the model is asked next")


class RetryArithmetic(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.question, self.answer = "", 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ArithmeticObservation:
        rng = random.Random(seed)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        op = rng.choice("+-")
        self.question, self.answer = f"{a} {op} {b}", a + b if op == "+" else a - b
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return ArithmeticObservation(prompt=f"What is {self.question}? Answer with the number only.")

    def step(self, action: ArithmeticAction, timeout_s: float | None = None, **kwargs: Any) -> ArithmeticObservation:
        self._state.step_count += 1
        numbers = _NUMBER.findall(action.message)
        right = bool(numbers) and int(numbers[-1]) == self.answer
        if right:
            return ArithmeticObservation(done=True, reward=1.0 if self._state.step_count == 1 else 0.5)
        if self._state.step_count >= TRIES:
            return ArithmeticObservation(done=True, reward=0.0)
        said = numbers[-1] if numbers else "no number"
        prompt = f"{said} is wrong. What is {self.question}? Answer with the number only."
        return ArithmeticObservation(prompt=prompt, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    RetryArithmetic, ArithmeticAction, ArithmeticObservation, env_name="retry_arithmetic", max_concurrent_envs=256
)
