"""Multi-turn RLVR: on a wrong answer, tell the model so and let it try again.

Each of the ``n_samples`` conversations runs until the reward is positive or
``max_turns`` answers were given. The trajectory is the whole conversation as generated
tokens: model turns are trained on (loss_mask 1), the prompt and the feedback turns are
not. Its reward is the last answer's reward times ``turn_discount ** (turns - 1)``, so a
later success is worth less.

The conversation is extended at the token level (the next request is exactly the
previous request + generated tokens + the feedback turn's tokens), never by
re-rendering decoded text, so what is trained on is exactly what the model saw. The
feedback turn's text comes from the chat template itself (rendered around a placeholder
assistant message).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

from tandemrl.api.inference import ModelResponse
from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.rewards.runner import RewardFn, RewardRunner
from tandemrl.utils import stats_tracker
from tandemrl.workflows.rlvr import RLVRWorkflow, build_row, check_response

DEFAULT_FEEDBACK = "Your answer is either wrong or not parsable to the reward function. Please try to answer it again."
_PLACEHOLDER = "\u2063TANDEMRL_ASSISTANT_TURN\u2063"


class MultiTurnWorkflow(RLVRWorkflow):
    """Retries a prompt with feedback until the answer is rewarded or ``max_turns`` is reached."""

    def __init__(
        self,
        reward_fn: RewardFn | RewardRunner,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        max_turns: int = 2,
        turn_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        enable_thinking: bool = False,
        reward_timeout: float | None = 15.0,
        dump_dir: str | None = None,
        stat_scope: str = "rollout",
        reward_workers: int = 64,
        max_context_len: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            reward_fn, gconfig, tokenizer, enable_thinking, reward_timeout, dump_dir, stat_scope, reward_workers, seed
        )
        if max_turns < 1:
            raise ValueError(f"MultiTurnWorkflow: max_turns must be >= 1, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"MultiTurnWorkflow: turn_discount must be in (0, 1], got {turn_discount}")
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.max_context_len = max_context_len
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []) or []) | set(gconfig.stop_token_ids)

    def feedback_suffix(self, messages: list[dict[str, Any]]) -> str:
        """Template text that closes an assistant turn, adds the feedback turn and reopens the assistant."""
        history = list(messages) + [{"role": "assistant", "content": _PLACEHOLDER}]
        full = self.tokenizer.apply_chat_template(
            history + [{"role": "user", "content": self.feedback}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
        )
        at = full.rfind(_PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template drops assistant message content; MultiTurnWorkflow cannot build turns")
        return full[at + len(_PLACEHOLDER) :]

    def feedback_ids(self, resp: ModelResponse, suffix: str) -> list[int]:
        """Tokens of the feedback turn, minus the end-of-turn token if the model already emitted it."""
        text = suffix
        if resp.output_tokens and resp.output_tokens[-1] in self._special_ids:
            last = self.tokenizer.decode([resp.output_tokens[-1]], skip_special_tokens=False)
            if last and text.startswith(last):
                text = text[len(last) :]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def _conversation(
        self,
        client: GenerationClient,
        data: dict[str, Any],
        prompt_ids: list[int],
        prompt: str,
        suffix: str,
        sample: int = 0,
    ) -> tuple[TensorDict, float, int] | None:
        rid = uuid.uuid4().hex  # one rid per conversation: its turns reuse one server's prefix cache
        gconfig = self.gconfig.new(n_samples=1)
        seq, loss_mask = list(prompt_ids), [0] * len(prompt_ids)
        logprobs, versions = [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
        turns, reward = 0, 0.0
        while True:
            resp = await client.agenerate(self.request(seq, gconfig, rid, self.sample_seed(data, sample, turns)))
            check_response(resp)
            seq += resp.output_tokens
            loss_mask += [1] * len(resp.output_tokens)
            logprobs += [float(x) for x in resp.output_logprobs]
            versions += [int(v) for v in resp.output_versions]
            turns += 1
            score = await self.score(prompt, prompt_ids, resp.output_tokens, data)
            if score is None:  # a failed reward: the group is dropped (see RLVRWorkflow)
                return None
            reward = score
            if reward > 0 or turns >= self.max_turns:
                break
            fb = self.feedback_ids(resp, suffix)
            if self.max_context_len is not None and len(seq) + len(fb) >= self.max_context_len:
                break
            seq += fb
            loss_mask += [0] * len(fb)
            logprobs += [0.0] * len(fb)
            versions += [-1] * len(fb)
        final = reward * self.turn_discount ** (turns - 1)
        return build_row(seq, loss_mask, logprobs, versions, final), final, turns

    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        prompt_ids = self.prompt_ids(data)
        suffix = self.feedback_suffix(data["messages"])
        prompt = self.tokenizer.decode(prompt_ids)
        results = await asyncio.gather(
            *[self._conversation(client, data, prompt_ids, prompt, suffix, i) for i in range(self.gconfig.n_samples)]
        )
        if self.drop_group([None if r is None else r[1] for r in results]):
            return None
        done = cast(list[tuple[TensorDict, float, int]], results)  # none failed (drop_group)
        tracker = stats_tracker.get(self.stat_scope)
        for row, reward, turns in done:
            tracker.scalar(reward=reward, num_turns=turns, seq_len=row["input_ids"].shape[1])
        return concat_padded_tensors([row for row, _, _ in done])
