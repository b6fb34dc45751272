"""verifiers environments in tandemrl (docs/environments.md, "verifiers"): the real verifiers 0.4 package in its own
virtualenv (``verifiers-test``, built by tests/side_venv.py once per machine: verifiers pins openai<3), the
environment process (tandemrl/workflows/verifiers_bridge.py), and GRPO steps on examples/verifiers_envs through the
launcher and the session's vLLM server."""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from side_venv import side_venv
from utils import LAUNCH_ENV, REPO_ROOT
from vllm_server import RunningServer

from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.configs.agent import AgentConfig
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.configs.verifiers import VerifiersConfig
from tandemrl.utils import stats_tracker
from tandemrl.workflows.agent import AgentWorkflow
from tandemrl.workflows.verifiers import VERIFIERS_VERSION, VerifiersEnv, ensure_task_rows, task_rows

ENVS = str(REPO_ROOT / "examples" / "verifiers_envs")
TEST_ENVS = str(REPO_ROOT / "tests" / "verifiers_envs")
ENV = LAUNCH_ENV


@pytest.fixture(scope="module")
def vf_python() -> str:
    return str(side_venv("verifiers-test", [f"verifiers=={VERIFIERS_VERSION}", "uv"]))


@pytest.mark.parametrize("test_size", [0, 3, 9])
def test_the_held_out_tasks_are_a_seeded_sample_no_training_row_shares(test_size: int) -> None:
    tasks = [{"idx": i, "prompt": f"q{i}"} for i in range(10)]
    rows = task_rows(tasks, test_size, seed=1)
    train, test = ({r["vf_task"] for r in rows[s]} for s in ("train", "test"))
    assert len(test) == test_size and not train & test and train | test == set(range(10))
    assert rows == task_rows(tasks, test_size, seed=1) and (test_size == 0 or rows != task_rows(tasks, test_size, 2))
    with pytest.raises(ValueError, match="verifiers.test_size=10: the environment has only 10 tasks"):
        task_rows(tasks, 10, seed=1)


@pytest.mark.slow
def test_a_missing_python_or_environment_is_one_line(vf_python: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"verifiers.python: /no/python does not exist; build it with"):
        VerifiersEnv(VerifiersConfig(env="sum_digits", python="/no/python"))
    config = VerifiersConfig(env="no_such_env", python=vf_python, paths=[ENVS])
    with pytest.raises(RuntimeError, match=r"verifiers env 'no_such_env': .*no_such_env") as err:
        VerifiersEnv(config)
    assert "\n" not in str(err.value)
    # the rows of an environment are written once; another environment's rows are refused, never overwritten
    config = VerifiersConfig(env="sum_digits", python=vf_python, paths=[ENVS], taskset_args={"size": 12}, test_size=2)
    assert ensure_task_rows(config, str(tmp_path)) and not ensure_task_rows(config, str(tmp_path))
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(train) == 10 and train[0]["question"].startswith("What is ") and "vf_task" in train[0]
    other = VerifiersConfig(env="sum_digits", python=vf_python, paths=[ENVS], taskset_args={"size": 13})
    with pytest.raises(ValueError, match="holds another environment's tasks"):
        ensure_task_rows(other, str(tmp_path))


@pytest.mark.slow
def test_the_environment_process_ends_with_the_process_that_started_it(vf_python: str, tmp_path: Path) -> None:
    """A trainer that dies without close() (os._exit here) leaves no environment process behind."""
    import psutil

    marker = str(tmp_path / "marker")  # a sys.path entry in the bridge's command line: only its processes match
    code = (
        "import os\nfrom tandemrl.configs.verifiers import VerifiersConfig\n"
        "from tandemrl.workflows.verifiers import VerifiersEnv\n"
        f"env = VerifiersEnv(VerifiersConfig(env='sum_digits', python={vf_python!r}, paths=[{ENVS!r}, {marker!r}]))\n"
        "print(len(env.tasks), flush=True)\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "256", out.stdout + out.stderr  # the environment was up, its tasks listed

    def bridges() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if marker in " ".join(p.info["cmdline"] or []) and "verifiers_bridge.py" in " ".join(p.info["cmdline"]):
                found.append(p)
        return found

    _, alive = psutil.wait_procs(bridges(), timeout=60)  # the lifeline: SIGTERM, then SIGKILL after 5 s
    assert not alive and not bridges(), [p.info["cmdline"] for p in alive]


@pytest.mark.slow
def test_two_grpo_steps_on_an_unmodified_verifiers_environment(
    vf_python: str, tiny_model_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """Every episode's model calls went through the agent proxy to the server (the rows are its tokens), the
    environment's rubric scored each one (``vf/correct``), no group was dropped and the held-out split was
    evaluated."""
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/verifiers_grpo.py"]
    cmd += ["--config", "examples/verifiers_grpo.yaml", f"actor.engine.path={tiny_model_dir}"]
    cmd += [f"cluster.fileroot={tmp_path}", f"verifiers.python={vf_python}", "verifiers.taskset_args.size=40"]
    cmd += ["verifiers.test_size=8", "total_train_steps=2", "train_dataset.batch_size=4", "gconfig.n_samples=2"]
    cmd += ["gconfig.max_new_tokens=8", "valid_dataset.max_samples=4", "evaluator.freq_steps=2"]
    cmd += ["rollout.max_head_offpolicyness=0", *running_server.overrides]
    env = {**ENV, **running_server.env}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log_dir = tmp_path / "logs" / "verifiers-grpo" / "trial0"
    steps = [json.loads(line) for line in (log_dir / "stats.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        assert s["rollout/agent_calls"] == 1.0 and s["rollout/vf/turns"] == 1.0, s  # one turn, one proxied call
        assert 0.0 <= s["rollout/vf/correct"] <= 1.0 and s["rollout/vf/correct"] == s["rollout/reward"]
        assert s["rollout/group_dropped"] == 0.0 and s["rollout/agent_repair"] == 0.0
    assert "eval-rollout/vf/correct" in steps[-1], sorted(steps[-1])
    served = [p for p in running_server.requests() if p == "/inference/v1/generate"]
    assert len(served) >= 2 * 4 * 2, len(served)  # 2 steps x 4 tasks x 2 episodes, each one model call


class ToolUser:
    """The model's double for the tool environment (a random tiny model calls no tool): the first call of an
    episode answers with a ``<tool_call>`` for the prompt's word, the call after the tool's result with that
    result; any other prompt gets "Done.". Tokens are the tokenizer's, logprobs fixed, version 5."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], ModelResponse]] = []

    def get_version(self) -> int:
        return 5

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        text = self.tokenizer.decode(req.input_ids)
        result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if result:
            reply = f"The number is {result[-1]}."
        elif words := re.findall(r'with "(\w+)"', text):
            reply = '<tool_call>\n{"name": "words_lookup", "arguments": {"word": "' + words[-1] + '"}}\n</tool_call>'
        else:
            reply = "Done."
        ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        resp = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-0.5] * len(ids),
            output_versions=[5] * len(ids),
            stop_reason="stop",
        )
        self.calls.append((list(req.input_ids), resp))
        return resp


@pytest.mark.slow
def test_a_tool_environment_trains_on_both_turns_exact_tokens(vf_python: str, tiny_model_dir: str) -> None:
    """word_lookup (a verifiers tool served over MCP) through the agent proxy: each episode is two model calls,
    the second prompt extends the first call's prompt and output token for token, the row is the last prompt
    plus its output with loss only on the model's tokens, and the rubric found the tool's number."""
    from test_agent_proxy import KEEP_TEMPLATE
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = ToolUser(tokenizer)
    config = VerifiersConfig(env="word_lookup", python=vf_python, paths=[ENVS])
    with VerifiersEnv(config) as env:
        agent = AgentConfig(chat_template=KEEP_TEMPLATE, tool_parser="qwen2")
        gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=64)
        wf = AgentWorkflow(env.agent("vf-tools"), gconfig, tokenizer, agent, stat_scope="vf-tools")
        batch = asyncio.run(wf.arun_episode(model, {"vf_task": 1}))
    assert batch is not None and batch["rewards"].tolist() == [1.0, 1.0]
    assert len(model.calls) == 4
    for i in range(2):
        n = int(batch["attention_mask"][i].sum())
        ids, mask = batch["input_ids"][i, :n].tolist(), batch["loss_mask"][i, :n].tolist()
        mine = sorted((c for c in model.calls if ids[: len(c[0])] == c[0]), key=lambda c: len(c[0]))
        first, second = mine[0], mine[-1]  # both episodes' first calls have the same prompt
        assert len(first[0]) < len(second[0])
        assert second[0][: len(first[0]) + len(first[1].output_tokens)] == first[0] + first[1].output_tokens
        assert ids == second[0] + second[1].output_tokens
        glue = len(second[0]) - len(first[0]) - len(first[1].output_tokens)
        assert mask == [0] * len(first[0]) + [1] * len(first[1].output_tokens) + [0] * glue + [1] * (n - len(second[0]))
    stats = stats_tracker.get("vf-tools").export()
    assert stats["vf-tools/vf/turns"] == 2.0 and stats["vf-tools/vf/found"] == 1.0
    assert stats["vf-tools/agent_extend"] == 1.0 and stats["vf-tools/agent_repair"] == 0.0


@pytest.mark.slow
def test_an_environment_that_raises_drops_its_group_with_the_cause(vf_python: str, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    from tandemrl.api.episode import notes_in

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = VerifiersConfig(env="broken_reward", python=vf_python, paths=[TEST_ENVS])
    with VerifiersEnv(config) as env:
        wf = AgentWorkflow(env.agent("vf-broken"), GenerationHyperparameters(n_samples=2), tokenizer, AgentConfig())
        ctx = contextvars.copy_context()
        notes = notes_in(ctx)
        assert ctx.run(asyncio.run, wf.arun_episode(ToolUser(tokenizer), {"vf_task": 0})) is None
    assert {kind for kind, _ in notes.failures} == {"environment failed"} and len(notes.failures) == 2
    detail = notes.failures[0][1]
    assert detail.startswith("verifiers env 'broken_reward': ") and "ZeroDivisionError" in detail, detail
