"""A verifiers 0.4 environment (single turn): add two numbers, answer with the number alone.

Written against verifiers' own API only, as an environment from the Environments Hub is; tandemrl loads it by its
module name (``verifiers.env: sum_digits``, with this directory in ``verifiers.paths``). Its reward is 1 when the
reply's last number is the sum, else 0; ``size`` tasks from ``seed``, operands up to ``max_operand``.
"""

import random
import re

import verifiers.v1 as vf

__all__ = ["SumDigitsTaskset"]


class SumData(vf.TaskData):
    total: int
    """The sum the reply must end with."""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and int(numbers[-1]) == self.data.total else 0.0


class SumDigitsConfig(vf.TasksetConfig):
    size: int = 256
    seed: int = 0
    max_operand: int = 20


class SumDigitsTaskset(vf.Taskset[SumTask, SumDigitsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            prompt = f"What is {a} + {b}? Reply with the number only."
            yield SumTask(SumData(prompt=prompt, total=a + b), self.config.task)
