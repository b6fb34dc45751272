"""Agent workflow: run a user's OpenAI-client agent against the proxy and train on what it recorded.

Per episode (one dataset row) an :class:`~tandemrl.workflows.proxy.AgentProxy` starts on the
rollout's event loop, and ``gconfig.n_samples`` agent runs go through it concurrently, each
with its own session key::

    async def run(client: openai.AsyncOpenAI, sample: dict) -> float | list[float]

The return value is the final reward, or one reward per model call (in call order). A call's
return is its reward plus ``turn_discount`` times the next call's return, so a final reward
reaches earlier turns discounted. Samples (``AgentConfig.granularity``): one per stitched
trajectory (reward: the return of its first own call) or one per call (reward: that call's
return). Rows have RLVRWorkflow's layout (``tandemrl.workflows.rlvr``) with ``constrained``: 1 on
the outputs of calls that constrained their output (``structured_outputs``, ``response_format``).

A run that times out (``episode_timeout``) or raises :class:`EpisodeFailed` drops its group
(``<scope>/group_dropped``, the cause counted as a failing reward's is); any other error in the agent, or one
the proxy hit serving it, is raised (the executor's ``workflow_error_policy`` decides). With ``mode='fork'`` or
``granularity='turn'`` the rows per episode vary, which suits algorithms without per-group normalisation.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tandemrl.api.episode import note_failure, note_waited
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.agent import AgentConfig
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.utils import stats_tracker
from tandemrl.workflows.proxy.server import AgentProxy, AgentSession
from tandemrl.workflows.proxy.tool_parsers import get_tool_parser
from tandemrl.workflows.proxy.trajectory import Session
from tandemrl.workflows.rlvr import build_row

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]
_LINKS = ("extend", "repair", "fork", "branch", "new")


class EpisodeFailed(Exception):
    """An agent function's run failed for a reason outside the model (its environment raised or timed out): the
    group is dropped and ``kind`` with its one-line ``detail`` counted, as a failing reward's are."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def load_agent(spec: str) -> AgentFn:
    """The function named by ``'module:function'``."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"AgentConfig.agent must be 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"AgentConfig.agent: module {module!r} has no function {name!r}")
    return fn


def turn_returns(result: Any, n_calls: int, discount: float) -> list[float]:
    """Per-call returns from the agent's final reward or per-call reward list."""
    if isinstance(result, int | float) and not isinstance(result, bool):
        rewards = [0.0] * (n_calls - 1) + [float(result)]
    elif isinstance(result, list | tuple) and len(result) == n_calls:
        rewards = [float(r) for r in result]
    else:
        raise ValueError(
            f"the agent returned {result!r:.80}; expected a float or a list of one float per model call ({n_calls} calls)"
        )
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"the agent returned a non-finite reward: {rewards}")
    out, acc = [0.0] * n_calls, 0.0
    for i in reversed(range(n_calls)):
        acc = rewards[i] + discount * acc
        out[i] = acc
    return out


def session_rows(session: Session, returns: Sequence[float], granularity: str) -> list[TensorDict]:
    """Training rows of one session (see the module docstring)."""
    if granularity == "turn":
        return [
            build_row(
                c.prompt_ids + c.output_ids,
                [0] * len(c.prompt_ids) + [1] * len(c.output_ids),
                [0.0] * len(c.prompt_ids) + c.logprobs,
                [-1] * len(c.prompt_ids) + c.versions,
                returns[c.index],
                [0] * len(c.prompt_ids) + [int(c.constrained)] * len(c.output_ids),
            )
            for c in session.calls
        ]
    rows = []
    for t in session.trajectories:
        own = [i for i in t.calls if session.calls[i].trajectory == session.trajectories.index(t)]
        rows.append(build_row(t.tokens, t.loss_mask, t.logprobs, t.versions, returns[min(own)], t.constrained))
    return rows


class AgentWorkflow(RolloutWorkflow):
    """See the module docstring; ``agent`` is the function or its ``'module:function'`` name."""

    def __init__(
        self,
        agent: AgentFn | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        config: AgentConfig | None = None,
        stat_scope: str = "rollout",
    ) -> None:
        config = config or AgentConfig()
        if gconfig.n_samples < 1:
            raise ValueError(f"GenerationHyperparameters.n_samples must be >= 1, got {gconfig.n_samples}")
        if not 0.0 < config.turn_discount <= 1.0:
            raise ValueError(f"AgentConfig.turn_discount must be in (0, 1], got {config.turn_discount}")
        if config.granularity not in ("trajectory", "turn"):
            raise ValueError(f"AgentConfig.granularity must be 'trajectory' or 'turn', got {config.granularity!r}")
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        self.gconfig, self.tokenizer, self.config, self.stat_scope = gconfig, tokenizer, config, stat_scope
        template = config.chat_template
        if template is not None and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = template
        Session(config.mode)  # type: ignore[arg-type] # checks the mode
        get_tool_parser(config.tool_parser)

    def proxy(self, client: GenerationClient) -> AgentProxy:
        c = self.config
        return AgentProxy(
            client,
            self.tokenizer,
            self.gconfig.new(n_samples=1),
            mode=c.mode,  # type: ignore[arg-type]
            tool_parser=c.tool_parser,
            chat_template=self.chat_template,
            enable_thinking=c.enable_thinking,
            host=c.host,
            max_context_len=c.max_context_len,
        )

    async def run_agent(self, proxy: AgentProxy, data: dict[str, Any]) -> tuple[Session, Any] | None:
        """One agent run in its own session; None if it timed out."""
        import openai

        s: AgentSession = proxy.open_session()
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0)
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(self.agent(client, dict(data)), self.config.episode_timeout)
        except TimeoutError:
            stats_tracker.get(self.stat_scope).scalar(agent_timeout=1.0)
            note_failure(
                "agent timeout", f"an agent run took over agent.episode_timeout={self.config.episode_timeout}s"
            )
            return None
        except EpisodeFailed as failed:
            stats_tracker.get(self.stat_scope).scalar(agent_failed=1.0)
            note_failure(failed.kind, failed.detail)
            return None
        finally:
            # What the run did besides waiting for the model (its tools, its reward) is environment wait.
            note_waited(max(0.0, time.perf_counter() - start - s.model_seconds))
            await client.close()
            proxy.close_session(s)
        if s.errors:
            raise s.errors[0]
        return s.session, result

    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        async with self.proxy(client) as proxy:
            runs = await asyncio.gather(*[self.run_agent(proxy, data) for _ in range(self.gconfig.n_samples)])
        tracker = stats_tracker.get(self.stat_scope)
        dropped = any(r is None or not r[0].calls for r in runs)
        tracker.scalar(group_dropped=float(dropped))
        if dropped:
            return None
        rows: list[TensorDict] = []
        for session, result in runs:  # type: ignore[misc]
            returns = turn_returns(result, len(session.calls), self.config.turn_discount)
            rows += session_rows(session, returns, self.config.granularity)
            stats = {f"agent_{k}": float(session.stats[k]) for k in (*_LINKS, "tool_parse_failed", "repair_failed")}
            tracker.scalar(
                reward=returns[0], agent_calls=len(session.calls), agent_samples=len(session.trajectories), **stats
            )
        return concat_padded_tensors(rows)
