"""The OpenEnv environment of ``bench/async_agentic.py``'s ``openenv`` workload: examples/openenv_envs'
retry_arithmetic whose every step answers after a drawn latency, as a slow environment (a sandbox, a simulator)
would. ``$TANDEMRL_BENCH_ENV_LATENCY`` is ``lognormal,MEDIAN,P99`` (default ``lognormal,0.5,5.0``) or ``fixed,S``;
draws are seeded (``$TANDEMRL_BENCH_ENV_SEED``, default 0) in the order steps arrive. The wait is an asyncio sleep,
so concurrent sessions wait at once. It runs in the environment server (the openenv virtualenv), so it imports
only openenv and the example, not tandemrl:

    uvicorn openenv_slow_env:app   (with bench/ and examples/openenv_envs on PYTHONPATH)
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from typing import Any

from openenv.core.env_server.http_server import create_app
from retry_arithmetic import ArithmeticAction, ArithmeticObservation, RetryArithmetic

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile
_KIND, *_VALUES = os.environ.get("TANDEMRL_BENCH_ENV_LATENCY", "lognormal,0.5,5.0").split(",")
_RNG = random.Random(int(os.environ.get("TANDEMRL_BENCH_ENV_SEED", "0")))


def latency() -> float:
    if _KIND == "fixed":
        return float(_VALUES[0])
    median, p99 = (float(v) for v in _VALUES)
    return _RNG.lognormvariate(math.log(median), math.log(p99 / median) / _Z99)


class SlowRetryArithmetic(RetryArithmetic):
    async def step_async(
        self, action: ArithmeticAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ArithmeticObservation:
        await asyncio.sleep(latency())
        return self.step(action, timeout_s=timeout_s, **kwargs)


app = create_app(
    SlowRetryArithmetic,
    ArithmeticAction,
    ArithmeticObservation,
    env_name="slow_retry_arithmetic",
    max_concurrent_envs=512,
)
