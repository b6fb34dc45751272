"""`python -m tandemrl.eval`: scoring and the Wilson interval by hand, bad input, and a real vLLM run
compared with greedy transformers decoding of the same questions."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from utils import REPO_ROOT

from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.inference.server import _group_alive
from tandemrl.workflows.gsm8k_eval import (
    evaluate_gsm8k,
    mcnemar_exact_p,
    paired_change,
    score_completion,
    summarize,
    wilson_interval,
)

GOLD = "Half of 36 is 18.\n#### 18"


def _cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.eval", *args], capture_output=True, text=True, env=env, timeout=600, **kw
    )


# --------------------------------------------------------------------- scoring, no model


def test_scoring_of_hand_made_completions_and_wilson_interval() -> None:
    cases = [  # completion, extracted answer, correct
        ("She keeps half, 36 / 2 = 18.\n#### 18", "18", True),
        ("So the answer is \\boxed{18}.", "18", True),
        ("18 apples? No: she has 17 left.", "17", False),
        ("I cannot tell.", None, False),
        ("", None, False),
    ]
    questions = [score_completion(i, text, GOLD) for i, (text, _, _) in enumerate(cases)]
    assert [(q.extracted, q.correct) for q in questions] == [(e, c) for _, e, c in cases]
    assert all(q.gold == "18" for q in questions)
    result = summarize(questions, max_new_tokens=7, chat_template=False, seconds=0.0)
    assert (result.n, result.correct, result.accuracy) == (5, 2, 0.4)
    # 2/5 at 95%: p=0.4, z^2/n=0.768292; center 0.443448, half-width 0.325827 (worked by hand).
    assert result.interval_low == pytest.approx(0.117621, abs=2e-6)
    assert result.interval_high == pytest.approx(0.769275, abs=2e-6)
    assert result.to_dict()["indices"] == [0, 1, 2, 3, 4]
    # The ends: the interval stays inside [0, 1] and is not degenerate at 0/n or n/n.
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(0.277533, abs=2e-6)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(10, 10)[0] == pytest.approx(0.722467, abs=2e-6)
    with pytest.raises(ValueError, match="n > 0"):
        wilson_interval(0, 0)


def test_paired_change_counts_gained_and_lost_questions_with_exact_mcnemar_p() -> None:
    right, wrong = "#### 18", "#### 17"
    before = summarize([score_completion(i, t, GOLD) for i, t in enumerate([right, wrong, wrong, wrong])], 8, False, 0)
    after = summarize([score_completion(i, t, GOLD) for i, t in enumerate([wrong, right, right, wrong])], 8, False, 0)
    change = paired_change(before, after)
    # Discordant pairs b=2 (gained), c=1 (lost): p = 2 * (C(3,0) + C(3,1)) / 2^3 = 1.0 (by hand).
    assert (change.gained, change.lost, change.p_value) == (2, 1, 1.0)
    assert change.line() == "+2 / -1 questions, exact McNemar p=1"
    # 9 gained, 0 lost: 2 / 2^9 = 0.00390625; 10 gained, 2 lost: 2 * (1 + 12 + 66) / 4096 = 0.0385742.
    assert mcnemar_exact_p(9, 0) == pytest.approx(0.00390625)
    assert mcnemar_exact_p(10, 2) == pytest.approx(0.0385742, abs=1e-7)
    assert mcnemar_exact_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="different questions"):
        paired_change(before, summarize(after.questions[:3], 8, False, 0))


class _CannedEngine:
    """In-process GenerationClient: answers row i's prompt with ``answers[i]``; holds each request
    until ``hold_until`` requests are in flight together (bounded wait), and records the peak."""

    def __init__(self, tokenizer: Any, prompts: list[list[int]], answers: list[str], hold_until: int) -> None:
        self.tokenizer, self.answers, self.hold_until = tokenizer, answers, hold_until
        self.by_prompt = {tuple(p): i for i, p in enumerate(prompts)}
        self.in_flight = self.peak = 0
        self.full = asyncio.Event()

    def get_version(self) -> int:
        return 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        assert req.gconfig.greedy and req.gconfig.max_new_tokens == 9
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight >= self.hold_until:
            self.full.set()
        await asyncio.wait_for(self.full.wait(), timeout=60)
        self.in_flight -= 1
        text = self.answers[self.by_prompt[tuple(req.input_ids)]]
        out = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_versions=[0] * len(out))


@pytest.mark.parametrize("concurrency", [None, 3])
def test_evaluate_gsm8k_keeps_row_order_and_bounds_requests_in_flight(
    tiny_model_dir: str, gsm8k_dir: str, concurrency: int | None
) -> None:
    from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
    from tandemrl.models.hf import load_hf_tokenizer
    from tandemrl.rewards.gsm8k import extract_reference_answer
    from tandemrl.workflows.rlvr import chat_prompt_ids

    tokenizer = load_hf_tokenizer(tiny_model_dir)
    rows = get_gsm8k_rl_dataset(gsm8k_dir, "test", tokenizer, rank=0, world_size=1, max_samples=6).to_list()
    golds = [extract_reference_answer(r["answer"]) for r in rows]
    answers = [f"#### {g}" if i % 2 == 0 else "#### 0.5" for i, g in enumerate(golds)]
    prompts = [chat_prompt_ids(tokenizer, r["messages"]) for r in rows]  # what GRPO training sends
    engine = _CannedEngine(tokenizer, prompts, answers, hold_until=concurrency or len(rows))
    result = evaluate_gsm8k(engine, tokenizer, rows, max_new_tokens=9, concurrency=concurrency)
    assert engine.peak == (concurrency or len(rows))
    assert [q.index for q in result.questions] == list(range(6))
    assert [q.extracted for q in result.questions] == [g if i % 2 == 0 else "0.5" for i, g in enumerate(golds)]
    assert [q.correct for q in result.questions] == [True, False] * 3
    assert (result.correct, result.accuracy, result.chat_template) == (3, 0.5, True)
    assert (result.interval_low, result.interval_high) == wilson_interval(3, 6)
    with pytest.raises(ValueError, match="no rows"):
        evaluate_gsm8k(engine, tokenizer, [], max_new_tokens=9)


# --------------------------------------------------------------------- bad input


def test_missing_model_dir_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    r = _cli(str(missing))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: model directory not found: {missing}"


def test_missing_split_file_is_one_line(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    r = _cli(tiny_model_dir, "--data", gsm8k_dir, "--split", "validation", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert lines == [r.stderr.strip().splitlines()[-1]]
    assert os.path.join(gsm8k_dir, "validation.jsonl") in lines[0]
    assert not (tmp_path / "r.json").exists()


# --------------------------------------------------------------------- real server vs transformers


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
    """fp32 greedy continuation (stopping after an eos token) and its smallest top-2 logit gap."""
    step, out, gap = model(torch.tensor([prompt]), use_cache=True), [], float("inf")
    for _ in range(max_new):
        top = torch.topk(step.logits[0, -1].float(), 2)
        gap = min(gap, float(top.values[0] - top.values[1]))
        tok = int(top.indices[0])
        out.append(tok)
        if tok in eos:
            break
        step = model(torch.tensor([[tok]]), past_key_values=step.past_key_values, use_cache=True)
    return out, gap


def _server_pid(stdout: str) -> int:
    for line in stdout.splitlines():
        if line.startswith("[eval] vLLM server pid "):
            return int(line.split()[4])
    raise AssertionError(f"no server pid line in the CLI output:\n{stdout}")


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["smollm2_dir"])  # any HF checkpoint fixture
def test_cli_matches_transformers_greedy(
    model_fixture: str, request: pytest.FixtureRequest, gsm8k_dir: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
    from tandemrl.models.hf import load_hf_tokenizer
    from tandemrl.rewards.gsm8k import extract_final_answer, gsm8k_reward_fn
    from tandemrl.workflows.rlvr import chat_prompt_ids

    # On smollm2-135m this is also the check that the built directory reloads in vLLM (served in fp32 here)
    # with transformers' greedy output, and that the tied lm_head survives there.
    model_dir = request.getfixturevalue(model_fixture)
    n, max_new = 8, 32
    out = tmp_path / "report.json"
    args = ["--data", gsm8k_dir, "--n", str(n), "--max-new-tokens", str(max_new), "--dtype", "float32"]
    r = _cli(model_dir, *args, "--out", str(out), "--server-log", str(tmp_path / "server.log"))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert not _group_alive(_server_pid(r.stdout)), "the vLLM server outlived the CLI"
    assert "95% Wilson score interval" in r.stdout
    report = json.loads(out.read_text())

    tokenizer = load_hf_tokenizer(model_dir)
    rows = get_gsm8k_rl_dataset(gsm8k_dir, "test", tokenizer, rank=0, world_size=1, max_samples=n).to_list()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = {int(t) for t in (model.generation_config.eos_token_id, tokenizer.eos_token_id) if t is not None}
    expected, min_gap = [], float("inf")
    for row in rows:  # the training workflow's prompt: the RL dataset's chat messages, templated
        ids, gap = _hf_greedy(model, chat_prompt_ids(tokenizer, row["messages"]), max_new, eos)
        min_gap = min(min_gap, gap)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        correct = gsm8k_reward_fn(None, text, None, None, answer=row["answer"]) == 1.0
        expected.append(
            {"index": row["id"], "generated": text, "extracted": extract_final_answer(text), "correct": correct}
        )

    got = [{k: q[k] for k in ("index", "generated", "extracted", "correct")} for q in report["questions"]]
    assert got == expected, f"server vs transformers greedy differ (smallest top-2 logit gap {min_gap:.2e})"
    assert report["indices"] == list(range(n))
    assert [q["gold"] for q in report["questions"]] == [
        r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows
    ]
    n_correct = sum(e["correct"] for e in expected)
    assert (report["n"], report["correct"], report["accuracy"]) == (n, n_correct, n_correct / n)
    assert report["interval_low"] <= report["accuracy"] <= report["interval_high"]
    assert report["interval_method"] == "Wilson score interval, 95%"
    assert (report["split"], report["max_new_tokens"], report["prompt_format"]) == ("test", max_new, "chat_template")
    assert report["model"] == os.path.abspath(model_dir) and report["wall_seconds"] > 0


@pytest.mark.slow
def test_ctrl_c_while_the_server_starts_leaves_no_process(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    # A terminal's foreground process starts with SIGINT at its default. pytest itself may not: a shell that
    # starts it in the background (nohup cmd &) hands it SIGINT ignored, children inherit that through exec,
    # and Python then installs no KeyboardInterrupt handler. Start the CLI as a terminal would.
    start = "import signal, runpy, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    start += "sys.argv[0] = 'tandemrl.eval'; runpy.run_module('tandemrl.eval', run_name='__main__', alter_sys=True)"
    cmd = [sys.executable, "-c", start, tiny_model_dir, "--data", gsm8k_dir, "--n", "2"]
    with subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        seen = []
        for line in proc.stdout:  # the CLI prints this line right after the server process exists
            seen.append(line)
            if line.startswith("[eval] vLLM server pid "):
                break
        pid = _server_pid("".join(seen))
        assert _group_alive(pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    # Other processes that share stderr (e.g. multiprocessing's resource tracker) may write after the CLI's
    # own last line, so look for the line rather than require it last.
    assert proc.returncode == 130, err
    assert "error: interrupted" in err.splitlines(), err[-3000:]
    assert not _group_alive(pid), "the vLLM server outlived the interrupted CLI"
    assert not (tmp_path / "r.json").exists()
