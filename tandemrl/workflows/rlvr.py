"""Single-turn RL with verifiable rewards: n samples of one prompt, each scored by a reward function.

Trajectory layout (one row per sample, right-padded to the group's longest row):

* ``input_ids``  [n, L] long: prompt tokens then completion tokens.
* ``loss_mask``  [n, L] long: 0 on prompt and padding, 1 on completion tokens.
* ``logprobs``   [n, L] float32: 0 on prompt/padding; on completion tokens the behaviour
  log-prob of *that* token, i.e. ``logprobs[i, t] = log pi_old(input_ids[i, t] | input_ids[i, :t])``.
  Token-aligned, like ``loss_mask``: a trainer computing next-token log-probs from the
  logits at position t - 1 compares them with ``logprobs[:, t]`` (shift left by one, as
  ``tandemrl.models.functional.next_token_mask`` does for the mask).
* ``versions``   [n, L] long: weight version that sampled each completion token; -1 on
  prompt and padding.
* ``attention_mask`` [n, L] bool; ``rewards`` [n] float32.
* ``constrained`` [n, L] long, optional (the agent workflow): 1 on completion tokens of a call
  sent with an output constraint (structured outputs), see ``tandemrl.algorithms.constrained``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any, cast

import torch

from tandemrl.api.determinism import request_seed
from tandemrl.api.episode import note_generated
from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.rewards.runner import RewardFn, RewardRunner
from tandemrl.utils import stats_tracker
from tandemrl.utils.files import append_text

# Arguments the workflow passes to reward functions itself; dataset columns of the same
# name are not forwarded.
_REWARD_ARGS = ("prompt", "completions", "prompt_ids", "completion_ids")


def chat_prompt_ids(tokenizer: Any, messages: Any, enable_thinking: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, ending with the assistant header."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"row field 'messages' must be a non-empty list of chat messages, got {messages!r:.80}")
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_response(resp: ModelResponse) -> None:
    """Per-token outputs must line up with the output tokens."""
    n = len(resp.output_tokens)
    for name in ("output_logprobs", "output_versions"):
        got = len(getattr(resp, name))
        if got != n:
            raise ValueError(f"ModelResponse.{name} has {got} entries for {n} output tokens")


def build_row(
    input_ids: Sequence[int],
    loss_mask: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    reward: float,
    constrained: Sequence[int] | None = None,
) -> TensorDict:
    """One trajectory as a [1, L] padded batch (see the module docstring for the layout).

    ``constrained`` (optional, token-aligned): 1 on generated tokens of a call sent with an output
    constraint (structured outputs); the trainer leaves out those the constraint forced
    (``tandemrl.algorithms.constrained``). Given for one row of a batch, give it for all.
    """
    n = len(input_ids)
    fields = (("loss_mask", loss_mask), ("logprobs", logprobs), ("versions", versions))
    for name, seq in (*fields, ("constrained", constrained or [0] * n)):
        if len(seq) != n:
            raise ValueError(f"build_row: {name} has {len(seq)} entries for {n} tokens")
    row: TensorDict = {
        "input_ids": torch.tensor([list(input_ids)], dtype=torch.long),
        "loss_mask": torch.tensor([list(loss_mask)], dtype=torch.long),
        "logprobs": torch.tensor([list(logprobs)], dtype=torch.float32),
        "versions": torch.tensor([list(versions)], dtype=torch.long),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
    }
    if constrained is not None:
        row["constrained"] = torch.tensor([list(constrained)], dtype=torch.long)
    return row


def completion_row(prompt_ids: Sequence[int], resp: ModelResponse, reward: float) -> TensorDict:
    """A prompt + one generated completion as a [1, L] row."""
    check_response(resp)
    p, o = len(prompt_ids), len(resp.output_tokens)
    return build_row(
        list(prompt_ids) + list(resp.output_tokens),
        [0] * p + [1] * o,
        [0.0] * p + [float(x) for x in resp.output_logprobs],
        [-1] * p + [int(v) for v in resp.output_versions],
        reward,
    )


class RLVRWorkflow(RolloutWorkflow):
    """Samples ``gconfig.n_samples`` completions of a chat prompt and scores each one.

    ``reward_fn(prompt=, completions=, prompt_ids=, completion_ids=, **row) -> float`` gets
    the decoded prompt and completion (special tokens skipped), their token ids and every
    other field of the dataset row (e.g. ``answer``). It runs in a ``RewardRunner`` thread
    with ``reward_timeout``. A sample whose reward fails (raises, hangs, returns a non-number)
    drops its whole group: GRPO-style advantages are relative to the group, so scoring it 0.0
    would teach the others a wrong baseline, and dropping one sample would change the group
    size. Failures are counted per sample (``<stat_scope>/reward_failed``) and per group
    (``<stat_scope>/group_dropped``); the batch is refilled from later prompts.

    ``seed`` (deterministic mode): every sample's request carries a sampling seed derived from
    it, the running rollout and the row's ``id`` (``tandemrl.api.determinism``); None sends none.
    """

    def __init__(
        self,
        reward_fn: RewardFn | RewardRunner,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool = False,
        reward_timeout: float | None = 15.0,
        dump_dir: str | None = None,
        stat_scope: str = "rollout",
        reward_workers: int = 64,
        seed: int | None = None,
    ) -> None:
        if gconfig.n_samples < 1:
            raise ValueError(f"GenerationHyperparameters.n_samples must be >= 1, got {gconfig.n_samples}")
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.stat_scope = stat_scope
        self.dump_dir = dump_dir
        self.seed = seed
        self.reward = (
            reward_fn
            if isinstance(reward_fn, RewardRunner)
            else RewardRunner(reward_fn, timeout=reward_timeout, max_workers=reward_workers, stat_scope=stat_scope)
        )
        self._dump_lock = threading.Lock()

    # ------------------------------------------------------------------ helpers
    def prompt_ids(self, data: dict[str, Any]) -> list[int]:
        if "messages" not in data:
            raise KeyError(f"row has no 'messages' field (fields: {sorted(data)})")
        return chat_prompt_ids(self.tokenizer, data["messages"], self.enable_thinking)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    async def score(
        self, prompt: str, prompt_ids: Sequence[int], completion_ids: Sequence[int], data: dict
    ) -> float | None:
        """Reward of one completion, computed off the event loop (None if the function failed)."""
        extra = {k: v for k, v in data.items() if k not in _REWARD_ARGS}
        return await self.reward(
            prompt=prompt,
            completions=self.decode(completion_ids),
            prompt_ids=list(prompt_ids),
            completion_ids=list(completion_ids),
            **extra,
        )

    def drop_group(self, rewards: Sequence[float | None]) -> bool:
        """Whether a failed reward (None) drops this group; counted in ``<stat_scope>/group_dropped``."""
        dropped = any(r is None for r in rewards)
        stats_tracker.get(self.stat_scope).scalar(group_dropped=float(dropped))
        return dropped

    def request(
        self, prompt_ids: Sequence[int], gconfig: GenerationHyperparameters, rid: str, seed: int | None = None
    ) -> ModelRequest:
        """``seed``: the request's sampling seed (see :meth:`sample_seed`); None lets the server pick."""
        metadata = {} if seed is None else {"seed": seed}
        return ModelRequest(
            rid=rid, input_ids=list(prompt_ids), gconfig=gconfig, tokenizer=self.tokenizer, metadata=metadata
        )

    def sample_seed(self, data: dict[str, Any], sample: int, turn: int = 0) -> int | None:
        """The sampling seed of sample ``sample`` (turn ``turn``) of this row; None unless ``seed`` is set."""
        return request_seed(self.seed, data, sample, turn)

    def record(self, resp: ModelResponse, reward: float) -> None:
        stats_tracker.get(self.stat_scope).scalar(
            reward=reward,
            completion_len=len(resp.output_tokens),
            truncated=float(resp.stop_reason == "length"),
        )

    def dump(self, prompt: str, resps: Sequence[ModelResponse], rewards: Sequence[float]) -> None:
        """Append the samples to ``dump_dir/<version>.jsonl`` (version of the first sampled token)."""
        if self.dump_dir is None:
            return
        versions = [v for r in resps for v in r.output_versions]
        version = min(versions) if versions else -1
        lines = [
            json.dumps(
                {
                    "version": version,
                    "prompt": prompt,
                    "completion": self.decode(r.output_tokens),
                    "reward": rew,
                    "completion_len": len(r.output_tokens),
                    "stop_reason": r.stop_reason,
                },
                ensure_ascii=False,
            )
            for r, rew in zip(resps, rewards, strict=True)
        ]
        os.makedirs(self.dump_dir, exist_ok=True)
        with self._dump_lock:
            append_text(os.path.join(self.dump_dir, f"{version}.jsonl"), "\n".join(lines) + "\n")

    # ------------------------------------------------------------------ episode
    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        prompt_ids = self.prompt_ids(data)
        gconfig = self.gconfig.new(n_samples=1)
        rid = uuid.uuid4().hex  # one rid: the client keeps a group on one server (prefix cache)
        resps = await asyncio.gather(
            *[
                client.agenerate(self.request(prompt_ids, gconfig, rid, self.sample_seed(data, i)))
                for i in range(self.gconfig.n_samples)
            ]
        )
        note_generated(len(resps), sum(len(r.output_tokens) for r in resps))  # the ledger counts a dropped group
        prompt = self.tokenizer.decode(prompt_ids)
        rewards = await asyncio.gather(*[self.score(prompt, prompt_ids, r.output_tokens, data) for r in resps])
        if self.drop_group(rewards):
            return None
        scored = cast(list[float], rewards)  # none failed (drop_group)
        rows = []
        for resp, reward in zip(resps, scored, strict=True):
            rows.append(completion_row(prompt_ids, resp, reward))
            self.record(resp, reward)
        self.dump(prompt, resps, scored)
        return concat_padded_tensors(rows)
