"""Rewards from an HTTP service: any URL speaking a small JSON protocol, or a generative judge on a vLLM server.

``RemoteReward(config)`` is an async reward function for the workflows (``RLVRWorkflow`` awaits it
through its ``RewardRunner``). Each call is one request; an attempt that times out
(``config.timeout``), cannot connect or gets HTTP 429/5xx is retried ``config.retries`` times after
``config.backoff * 2**i`` seconds (at most 10); a 4xx reply or an unreadable verdict fails at once.
A call that fails for good raises ``RewardServiceError``: the runner turns that into "no reward" and
the workflow drops the sample's whole group (never a silent 0). At most ``config.max_concurrency``
calls are in flight per process (a semaphore on the client's event loop). Each finished call records
``<scope>/reward_service/retries`` (retries it took) and ``<scope>/reward_service/failed`` (0 or 1).

URL protocol: ``POST <url>`` with ``{"prompt": ..., "completion": ..., <the dataset row's other
JSON fields, e.g. "question", "answer">}``; the reply is ``{"reward": <number>}``.

Judge: the auxiliary server ``config.judge`` (``tandemrl.api.aux_servers``) gets the question, the
completion and the reference answer in one chat message at temperature 0, its reply constrained to
``correct`` or ``incorrect`` (vLLM structured outputs): 1.0 or 0.0. Judge requests carry the run's
server token; requests to a URL never do.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any
from urllib.parse import urlsplit

from tandemrl.api.aux_servers import aux_server_addresses
from tandemrl.api.inference import HttpRequest
from tandemrl.configs.services import RewardServiceConfig, url_problem
from tandemrl.inference.http import MAX_BACKOFF, HttpClient, InferenceServerError
from tandemrl.utils import stats_tracker

JUDGE_PROMPT = (
    "You grade answers to math questions. Reply with one word: correct if the final answer of the "
    "response equals the reference answer's, else incorrect.\n\n"
    "Question:\n{question}\n\nResponse:\n{response}\n\nReference answer:\n{reference}"
)
VERDICTS = {"correct": 1.0, "incorrect": 0.0}
_SKIPPED = ("prompt_ids", "completion_ids")  # token ids the workflow passes; not sent


class RewardServiceError(RuntimeError):
    """A reward call failed for good; ``retries``: how many retries it took first."""

    def __init__(self, message: str, retries: int) -> None:
        super().__init__(message)
        self.retries = retries


class _Final(Exception):
    """An attempt failed in a way a retry would not fix (a 4xx, an unreadable reply)."""


class RemoteReward:
    """``await reward(prompt=, completions=, **row) -> float`` from a reward service; see the module docstring."""

    self_timed = True  # bounds its own attempts: RewardRunner adds no timeout (queueing is not failure)

    def __init__(
        self, config: RewardServiceConfig, stat_scope: str = "rollout", addrs: list[str] | None = None
    ) -> None:
        if not config.enabled:
            raise ValueError("reward_service: set reward_service.url or reward_service.judge")
        self.config = config
        self.stat_scope = stat_scope
        self.__name__ = f"judge {config.judge!r}" if config.judge else f"reward service {config.url}"
        if config.judge:
            self.addrs, self.path = addrs or aux_server_addresses(config.judge), "/v1/chat/completions"
        else:
            problem = url_problem(config.url)
            if problem:
                raise ValueError(f"reward_service.url {problem}")
            parts = urlsplit(config.url)
            self.addrs = [f"{parts.scheme}://{parts.netloc}"]
            self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._next = itertools.cycle(range(len(self.addrs)))
        self._client = HttpClient("tandemrl-reward", send_token=bool(config.judge))
        self._sem: asyncio.Semaphore | None = None  # made on the client's loop, where every call runs

    async def __call__(self, prompt: str, completions: str, **row: Any) -> float:
        scope = stats_tracker.get(self.stat_scope)
        try:
            if self.config.judge:
                body = self._judge_body(prompt, completions, row)
            else:
                body = self._url_body(prompt, completions, row)
            reward, retries = await asyncio.wrap_future(self._client.submit(self._call(body)))
        except RewardServiceError as err:
            scope.scalar(**{"reward_service/retries": err.retries, "reward_service/failed": 1.0})
            raise
        scope.scalar(**{"reward_service/retries": retries, "reward_service/failed": 0.0})
        return reward

    async def _call(self, body: dict[str, Any]) -> tuple[float, int]:
        """(reward, retries) on the client's loop: at most ``max_concurrency`` at once, bounded retries."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.max_concurrency)
        cfg = self.config
        req = HttpRequest("POST", self.path, json=body, timeout=cfg.timeout)
        async with self._sem:
            for attempt in itertools.count():
                addr = self.addrs[next(self._next)]
                try:
                    reply = await self._client.send(addr, req)
                    return self._parse(reply), attempt
                except InferenceServerError as err:
                    if not err.retryable or attempt >= cfg.retries:
                        tries = f" after {attempt} retries" if attempt else ""
                        raise RewardServiceError(f"{self.__name__} failed{tries}: {err}", attempt) from None
                except _Final as err:
                    raise RewardServiceError(f"{self.__name__}: {err}", attempt) from None
                await asyncio.sleep(min(cfg.backoff * 2**attempt, MAX_BACKOFF))
        raise AssertionError("unreachable")

    def _url_body(self, prompt: str, completion: str, row: dict[str, Any]) -> dict[str, Any]:
        body = {"prompt": prompt, "completion": completion}
        for key, value in row.items():
            if key not in _SKIPPED and key not in body and _is_json(value):
                body[key] = value
        return body

    def _judge_body(self, prompt: str, completion: str, row: dict[str, Any]) -> dict[str, Any]:
        if "answer" not in row:
            raise RewardServiceError(f"{self.__name__}: the row has no 'answer' field to judge against", 0)
        text = JUDGE_PROMPT.format(question=row.get("question", prompt), response=completion, reference=row["answer"])
        return {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.config.judge_max_tokens,
            "temperature": 0.0,
            "structured_outputs": {"choice": list(VERDICTS)},
        }

    def _parse(self, reply: Any) -> float:
        if self.config.judge:
            try:
                verdict = str(reply["choices"][0]["message"]["content"]).strip().lower()
            except (KeyError, IndexError, TypeError):
                raise _Final(f"reply has no choices[0].message.content: {str(reply)[:120]}") from None
            if verdict not in VERDICTS:
                raise _Final(f"verdict {verdict[:40]!r} is neither {' nor '.join(VERDICTS)}")
            return VERDICTS[verdict]
        value = reply.get("reward") if isinstance(reply, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Final(f"reply {str(reply)[:120]} has no numeric 'reward'")
        return float(value)

    def close(self) -> None:
        self._client.close()


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
