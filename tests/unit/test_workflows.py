"""Workflows (RLVR, ReMax, multi-turn) and concat_padded_tensors, with the real tiny tokenizer.

Generation goes through a scripted in-process engine (a stand-in for the HTTP transport
only): it returns the token ids of given texts plus eos, with known logprobs/versions.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.data.batch import concat_padded_tensors
from tandemrl.data.gsm8k import user_messages
from tandemrl.models.hf import load_hf_tokenizer
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.rollout.executor import WorkflowExecutor
from tandemrl.utils import stats_tracker
from tandemrl.workflows.multi_turn import DEFAULT_FEEDBACK, MultiTurnWorkflow
from tandemrl.workflows.remax import ReMaxRLVRWorkflow
from tandemrl.workflows.rlvr import RLVRWorkflow, chat_prompt_ids

KEYS = {"input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards"}
QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    return load_hf_tokenizer(tiny_model_dir)


def expected_logprobs(n: int) -> list[float]:
    return [-(0.1 + 0.01 * j) for j in range(n)]


class ScriptedEngine:
    """Replies with ``pick(request, call_index)`` as tokens + eos; version fixed."""

    def __init__(self, tokenizer: Any, pick: Callable[[ModelRequest, int], str], version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.pick = pick
        self.version = version
        self.requests: list[ModelRequest] = []
        self.truncate_versions = False

    def get_version(self) -> int:
        return self.version

    def completion_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.tokenizer.eos_token_id]

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        index = len(self.requests)
        self.requests.append(req)
        ids = self.completion_ids(self.pick(req, index))
        await asyncio.sleep(0.001 * (5 - index % 5))  # finish out of submission order
        versions = [self.version] * len(ids)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=expected_logprobs(len(ids)),
            output_versions=versions[:-1] if self.truncate_versions else versions,
            stop_reason="stop",
        )


def cycle_texts(texts: list[str]) -> Callable[[ModelRequest, int], str]:
    return lambda req, i: texts[i % len(texts)]


def row(question: str = QUESTION, answer: str = ANSWER) -> dict[str, Any]:
    return {"messages": user_messages(question), "question": question, "answer": answer}


# ----------------------------------------------------------------------------- concat
def test_concat_padded_tensors_right_pads_to_the_longest() -> None:
    a = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.bool),
        "versions": torch.tensor([[-1, 0, 0]]),
        "logprobs": torch.tensor([[0.0, -0.5, -0.25]]),
        "rewards": torch.tensor([1.0]),
        "emb": torch.ones(1, 3, 2),
    }
    b = {
        "input_ids": torch.tensor([[4, 5], [6, 0]]),
        "attention_mask": torch.tensor([[True, True], [True, False]]),
        "versions": torch.tensor([[-1, 2], [-1, -1]]),
        "logprobs": torch.tensor([[0.0, -1.0], [0.0, 0.0]]),
        "rewards": torch.tensor([0.0, 0.5]),
        "emb": torch.full((2, 2, 2), 2.0),
    }
    out = concat_padded_tensors([b, a])
    assert out["input_ids"].tolist() == [[4, 5, 0], [6, 0, 0], [1, 2, 3]]
    assert out["attention_mask"].tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert out["attention_mask"].dtype == torch.bool
    assert out["versions"].tolist() == [[-1, 2, -1], [-1, -1, -1], [-1, 0, 0]]  # versions pad with -1
    assert out["logprobs"][0].tolist() == [0.0, -1.0, 0.0]
    assert out["rewards"].tolist() == [0.0, 0.5, 1.0]
    assert out["emb"].shape == (3, 3, 2) and out["emb"][0, 2].tolist() == [0.0, 0.0]
    custom = concat_padded_tensors([b, a], pad_values={"input_ids": 99})
    assert custom["input_ids"][1].tolist() == [6, 0, 99]


def test_concat_padded_tensors_errors_name_the_problem() -> None:
    good = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.bool)}
    with pytest.raises(ValueError, match="no batches"):
        concat_padded_tensors([])
    with pytest.raises(ValueError, match=r"item 1 differs from item 0 in keys \['rewards'\]"):
        concat_padded_tensors([good, {**good, "rewards": torch.zeros(1)}])
    with pytest.raises(ValueError, match="item 0 needs a 2-D 'attention_mask'"):
        concat_padded_tensors([{"input_ids": torch.zeros(1, 2)}])
    with pytest.raises(ValueError, match="field 'rewards' has shape \\(3,\\), expected leading batch dim 1"):
        concat_padded_tensors([{**good, "rewards": torch.zeros(3)}])


# ----------------------------------------------------------------------------- RLVR
def test_rlvr_tensor_layout_and_rewards(tokenizer: Any) -> None:
    texts = ["Half of 48 is 24 and 48+24=72.\n#### 72", "#### 71", "I am not sure, maybe 72?"]
    engine = ScriptedEngine(tokenizer, cycle_texts(texts))
    seen: list[dict[str, Any]] = []

    def reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **kw: Any) -> float:
        seen.append({"prompt": prompt, "completions": completions, "prompt_ids": prompt_ids, **kw})
        return gsm8k_reward_fn(prompt, completions, prompt_ids, completion_ids, **kw)

    gconfig = GenerationHyperparameters(n_samples=3, max_new_tokens=32)
    wf = RLVRWorkflow(reward_fn, gconfig, tokenizer, stat_scope="test-rlvr")
    data = row()
    out = asyncio.run(wf.arun_episode(engine, data))
    assert out is not None and set(out) == KEYS

    prompt_ids = chat_prompt_ids(tokenizer, data["messages"])
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    p = len(prompt_ids)
    completions = [engine.completion_ids(t) for t in texts]
    length = p + max(len(c) for c in completions)
    assert out["input_ids"].shape == (3, length) and out["rewards"].shape == (3,)
    assert out["input_ids"].dtype == torch.long and out["loss_mask"].dtype == torch.long
    assert out["logprobs"].dtype == torch.float32 and out["versions"].dtype == torch.long
    assert out["attention_mask"].dtype == torch.bool and out["rewards"].dtype == torch.float32
    for i, comp in enumerate(completions):
        n, pad = p + len(comp), length - p - len(comp)
        assert out["input_ids"][i, :n].tolist() == prompt_ids + comp
        assert out["attention_mask"][i].tolist() == [True] * n + [False] * pad
        assert out["loss_mask"][i].tolist() == [0] * p + [1] * len(comp) + [0] * pad
        # token-aligned: position t holds the logprob of input_ids[t]
        assert out["logprobs"][i, p:n].tolist() == pytest.approx(expected_logprobs(len(comp)))
        assert out["logprobs"][i, :p].abs().sum() == 0 and out["logprobs"][i, n:].abs().sum() == 0
        assert out["versions"][i].tolist() == [-1] * p + [3] * len(comp) + [-1] * pad
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]  # "maybe 72?" ends with the right number

    # every request: one sample, the same prompt, one rid for the group
    assert len(engine.requests) == 3
    assert {r.gconfig.n_samples for r in engine.requests} == {1}
    assert len({r.rid for r in engine.requests}) == 1
    assert all(r.input_ids == prompt_ids for r in engine.requests)
    # the reward function saw decoded text (eos stripped) and the dataset columns
    assert sorted(s["completions"] for s in seen) == sorted(texts)
    assert all(s["answer"] == ANSWER and s["question"] == QUESTION and "messages" in s for s in seen)
    assert all(s["prompt"] == tokenizer.decode(prompt_ids) and s["prompt_ids"] == prompt_ids for s in seen)

    stats = stats_tracker.get("test-rlvr").export()
    assert stats["test-rlvr/reward"] == pytest.approx(2 / 3) and stats["test-rlvr/reward__count"] == 3
    assert stats["test-rlvr/reward_failed"] == 0.0


def test_rlvr_reward_failures_drop_the_group_and_are_counted(tokenizer: Any) -> None:
    def broken(**kw: Any) -> float:
        raise RuntimeError("reward service down")

    release, returned = threading.Event(), threading.Event()

    def hangs(**kw: Any) -> float:  # until the test lets it go, after the episode has given up on it
        release.wait(60)
        returned.set()
        return 1.0

    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 72"]))
    gconfig = GenerationHyperparameters(n_samples=2)
    wf = RLVRWorkflow(broken, gconfig, tokenizer, stat_scope="test-rlvr-fail")
    assert asyncio.run(wf.arun_episode(engine, row())) is None  # the group is dropped, not scored 0
    assert wf.reward.n_errors == 2

    wf = RLVRWorkflow(hangs, gconfig, tokenizer, reward_timeout=0.1, stat_scope="test-rlvr-fail")
    try:
        out = asyncio.run(wf.arun_episode(engine, row()))
        assert not returned.is_set()  # the episode ended on the timeouts, not on the rewards returning
    finally:
        release.set()
    assert out is None
    assert wf.reward.n_timeouts == 2

    calls = iter(range(100))

    def every_other(**kw: Any) -> float:  # one sample of the group fails: the whole group goes
        if next(calls) % 2:
            raise RuntimeError("flaky")
        return 1.0

    wf = RLVRWorkflow(every_other, gconfig, tokenizer, stat_scope="test-rlvr-fail")
    assert asyncio.run(wf.arun_episode(engine, row())) is None
    stats = stats_tracker.get("test-rlvr-fail").export()
    assert stats["test-rlvr-fail/reward_failed"] == 5 / 6 and stats["test-rlvr-fail/reward_failed__count"] == 6
    assert stats["test-rlvr-fail/group_dropped"] == 1.0 and stats["test-rlvr-fail/group_dropped__count"] == 3


def test_rlvr_bad_inputs_are_clear_errors(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 72"]))
    wf = RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=1), tokenizer)
    with pytest.raises(KeyError, match="no 'messages' field"):
        asyncio.run(wf.arun_episode(engine, {"question": QUESTION, "answer": ANSWER}))
    with pytest.raises(ValueError, match="'messages' must be a non-empty list"):
        asyncio.run(wf.arun_episode(engine, {"messages": [], "answer": ANSWER}))
    engine.truncate_versions = True
    with pytest.raises(ValueError, match="ModelResponse.output_versions has"):
        asyncio.run(wf.arun_episode(engine, row()))
    with pytest.raises(ValueError, match="n_samples"):
        RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=0), tokenizer)


def test_rlvr_dump_dir_writes_jsonl(tokenizer: Any, tmp_path: Path) -> None:
    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 72", "#### 1"]), version=5)
    wf = RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=2), tokenizer, dump_dir=str(tmp_path))
    asyncio.run(wf.arun_episode(engine, row()))
    lines = [json.loads(x) for x in (tmp_path / "5.jsonl").read_text().splitlines()]
    assert sorted((x["completion"], x["reward"]) for x in lines) == [("#### 1", 0.0), ("#### 72", 1.0)]


# ----------------------------------------------------------------------------- ReMax
@pytest.mark.parametrize(("greedy_text", "expected"), [("#### 72", [0.0, -1.0]), ("#### 9", [1.0, 0.0])])
def test_remax_subtracts_the_greedy_reward(tokenizer: Any, greedy_text: str, expected: list[float]) -> None:
    sampled = ["#### 72", "#### 3"]
    counter = {"n": 0}

    def pick(req: ModelRequest, i: int) -> str:
        if req.gconfig.greedy:
            return greedy_text
        counter["n"] += 1
        return sampled[counter["n"] - 1]

    engine = ScriptedEngine(tokenizer, pick)
    wf = ReMaxRLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=2, temperature=0.7), tokenizer)
    out = asyncio.run(wf.arun_episode(engine, row()))
    assert out is not None and set(out) == KEYS
    assert out["rewards"].tolist() == expected  # per-sequence [n], greedy row not included
    greedy = [r for r in engine.requests if r.gconfig.greedy]
    assert len(greedy) == 1 and len(engine.requests) == 3
    p = len(chat_prompt_ids(tokenizer, row()["messages"]))
    first = out["input_ids"][0, p:][out["loss_mask"][0, p:].bool()].tolist()
    assert tokenizer.decode(first, skip_special_tokens=True) == "#### 72"


# ----------------------------------------------------------------------------- multi-turn
def test_multi_turn_retries_with_feedback_until_correct(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 5", "#### 72"]))
    wf = MultiTurnWorkflow(
        gsm8k_reward_fn, GenerationHyperparameters(n_samples=1), tokenizer, max_turns=3, turn_discount=0.5
    )
    data = row()
    out = asyncio.run(wf.arun_episode(engine, data))
    assert out is not None and set(out) == KEYS
    assert out["rewards"].tolist() == [0.5]  # right on the second turn
    assert len(engine.requests) == 2
    first, second = engine.requests
    turn1 = engine.completion_ids("#### 5")
    turn2 = engine.completion_ids("#### 72")
    fb = second.input_ids[len(first.input_ids) + len(turn1) :]
    assert second.input_ids[: len(first.input_ids) + len(turn1)] == first.input_ids + turn1  # token-level extension
    assert first.rid != "" and second.rid == first.rid

    seq = out["input_ids"][0].tolist()
    assert seq == second.input_ids + turn2
    # the whole trajectory is exactly the chat template's rendering of the conversation
    conversation = data["messages"] + [
        {"role": "assistant", "content": "#### 5"},
        {"role": "user", "content": DEFAULT_FEEDBACK},
        {"role": "assistant", "content": "#### 72"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(seq) + "\n" == rendered
    p = len(first.input_ids)
    assert out["loss_mask"][0].tolist() == [0] * p + [1] * len(turn1) + [0] * len(fb) + [1] * len(turn2)
    assert out["versions"][0].tolist() == [-1] * p + [3] * len(turn1) + [-1] * len(fb) + [3] * len(turn2)
    gen = out["loss_mask"][0].bool()
    assert out["logprobs"][0][~gen].abs().sum() == 0
    assert out["logprobs"][0][gen].tolist() == pytest.approx(
        expected_logprobs(len(turn1)) + expected_logprobs(len(turn2))
    )


def test_multi_turn_stops_after_max_turns(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, cycle_texts(["#### 1"]))
    wf = MultiTurnWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=2), tokenizer, max_turns=2)
    out = asyncio.run(wf.arun_episode(engine, row()))
    assert out is not None and out["rewards"].tolist() == [0.0, 0.0]
    assert len(engine.requests) == 4  # 2 conversations x 2 turns
    assert len({r.rid for r in engine.requests}) == 2  # one rid per conversation


# ----------------------------------------------------------------------------- end to end
def test_executor_runs_rlvr_on_gsm8k_rows(tokenizer: Any, gsm8k_dir: str) -> None:
    rows = []
    with open(Path(gsm8k_dir) / "test.jsonl", encoding="utf-8") as f:
        for line, _ in zip(f, range(6), strict=False):
            r = json.loads(line)
            rows.append(row(r["question"], r["answer"]))
    index = {r["question"]: i for i, r in enumerate(rows)}

    def pick(req: ModelRequest, i: int) -> str:
        """The reference solution for odd rows, a wrong number for even ones."""
        text = tokenizer.decode(req.input_ids)
        k = next(k for q, k in index.items() if q in text)
        return rows[k]["answer"] if k % 2 else "#### -1"

    engine = ScriptedEngine(tokenizer, pick)
    config = InferenceClientConfig(max_head_offpolicyness=0)
    ex = WorkflowExecutor(config, engine, consumer_batch_size=3)
    ex.initialize()
    try:
        wf = RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=2), tokenizer)
        engine.version = 0
        batch = ex.rollout_batch(
            rows[:3], wf, should_accept_fn=lambda t: bool(t["rewards"].max() > 0), timeout=60, max_rounds=2
        )
    finally:
        ex.destroy()
    assert batch["rewards"].shape == (6,)
    assert batch["rewards"].tolist() == [1.0] * 6  # only row 1 ever passes the filter
    assert ex.get_stats().rejected >= 2
