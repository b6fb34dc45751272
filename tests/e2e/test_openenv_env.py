"""OpenEnv environments in tandemrl (docs/environments.md, "OpenEnv"): the real openenv 0.10 package in its own
virtualenv (``openenv-test``, built by tests/side_venv.py once per machine), its environment server
(examples/openenv_envs/retry_arithmetic.py, unmodified) started by tandemrl, and GRPO steps through the launcher
and the session's vLLM server."""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from side_venv import side_venv
from utils import LAUNCH_ENV, REPO_ROOT
from vllm_server import RunningServer

from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.configs.agent import AgentConfig
from tandemrl.configs.openenv import OpenEnvConfig
from tandemrl.configs.rollout import GenerationHyperparameters
from tandemrl.utils import stats_tracker
from tandemrl.workflows.agent import AgentWorkflow
from tandemrl.workflows.openenv import OPENENV_VERSION, EnvServer, OpenEnv, check_config, ensure_seed_rows, seed_rows

ENVS = str(REPO_ROOT / "examples" / "openenv_envs")
APP = "retry_arithmetic:app"
ENV = LAUNCH_ENV


@pytest.fixture(scope="module")
def oe_python() -> str:
    return str(side_venv("openenv-test", [f"openenv=={OPENENV_VERSION}", "uvicorn"]))


def _env_servers(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "uvicorn" in cmd and marker in cmd:
            found.append(p)
    return found


def test_the_rows_are_reset_seeds_and_no_seed_is_in_both_splits(tmp_path: Path) -> None:
    rows = seed_rows(OpenEnvConfig(train_size=5, test_size=3))
    assert [r["seed"] for r in rows["train"]] == [0, 1, 2, 3, 4]
    assert [r["seed"] for r in rows["test"]] == [5, 6, 7]
    assert ensure_seed_rows(OpenEnvConfig(train_size=5, test_size=3), str(tmp_path)) is True
    assert ensure_seed_rows(OpenEnvConfig(train_size=5, test_size=3), str(tmp_path)) is False  # there already
    lines = (tmp_path / "test.jsonl").read_text().splitlines()
    assert [json.loads(x)["seed"] for x in lines] == [5, 6, 7]
    with pytest.raises(ValueError, match=r"train_dataset.path: .* holds other seed rows"):
        ensure_seed_rows(OpenEnvConfig(train_size=6, test_size=3), str(tmp_path))


def test_a_config_that_cannot_start_is_one_line_naming_the_key(tmp_path: Path) -> None:
    cases = [
        (OpenEnvConfig(), ValueError, "openenv.app and openenv.url: both empty"),
        (OpenEnvConfig(app="no_colon"), ValueError, "openenv.app: must be 'module:app'"),
        (OpenEnvConfig(url="localhost:8000"), ValueError, "openenv.url: 'localhost:8000' is not an http"),
        (OpenEnvConfig(app=APP, python="/no/python"), FileNotFoundError, "openenv.python: /no/python does not exist"),
        (OpenEnvConfig(url="http://x", paths=[str(tmp_path / "gone")]), FileNotFoundError, "openenv.paths: "),
    ]
    for config, kind, message in cases:
        with pytest.raises(kind, match=re.escape(message)) as err:
            check_config(config)
        assert "\n" not in str(err.value)


def test_a_launch_with_a_missing_environment_python_stops_before_any_process(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/openenv_grpo.py"]
    cmd += ["--config", "examples/openenv_grpo.yaml", f"cluster.fileroot={tmp_path}", "openenv.python=/no/python"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "openenv.python: /no/python does not exist" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("*server*.log"))


class Arithmetic:
    """The model's double (a random tiny model never answers right): the first call of an episode answers the
    question plus one, the call after "is wrong" the right number. Tokens are the tokenizer's, logprobs fixed,
    version 3."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], ModelResponse]] = []

    def get_version(self) -> int:
        return 3

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        text = self.tokenizer.decode(req.input_ids)
        a, op, b = re.findall(r"What is (\d+) ([+-]) (\d+)\?", text)[-1]
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        reply = str(right if "is wrong" in text else right + 1)
        ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        resp = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-0.25] * len(ids),
            output_versions=[3] * len(ids),
            stop_reason="stop",
        )
        self.calls.append((list(req.input_ids), resp))
        return resp


@pytest.mark.slow
def test_a_two_step_episode_trains_on_both_replies_exact_tokens(oe_python: str, tiny_model_dir: str) -> None:
    """retry_arithmetic through its server and the agent proxy: a wrong first answer, the environment's "is wrong"
    observation, a right second answer (reward 0.5 from the environment). The second prompt extends the first
    call's prompt and output token for token, the row is the last prompt plus its output with loss only on the
    model's tokens; an action field the environment does not have drops the group with the server's error."""
    from test_agent_proxy import KEEP_TEMPLATE
    from transformers import AutoTokenizer

    from tandemrl.api.episode import notes_in

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = Arithmetic(tokenizer)
    config = OpenEnvConfig(app=APP, python=oe_python, paths=[ENVS], observation_field="prompt", max_turns=3)
    server = EnvServer(config)
    try:
        server.wait_healthy(config.start_timeout)
        agent = AgentConfig(chat_template=KEEP_TEMPLATE)
        gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=16)
        wf = AgentWorkflow(OpenEnv(config, server.url).agent("oe"), gconfig, tokenizer, agent, stat_scope="oe")
        batch = asyncio.run(wf.arun_episode(model, {"seed": 7}))

        broken = OpenEnvConfig(**{**config.__dict__, "action_field": "text"})
        wf = AgentWorkflow(OpenEnv(broken, server.url).agent("oe-broken"), gconfig, tokenizer, AgentConfig())
        ctx = contextvars.copy_context()
        notes = notes_in(ctx)
        assert ctx.run(asyncio.run, wf.arun_episode(Arithmetic(tokenizer), {"seed": 7})) is None
    finally:
        server.stop()
    assert batch is not None and batch["rewards"].tolist() == [0.5, 0.5]
    assert len(model.calls) == 4
    for i in range(2):
        n = int(batch["attention_mask"][i].sum())
        ids, mask = batch["input_ids"][i, :n].tolist(), batch["loss_mask"][i, :n].tolist()
        mine = sorted((c for c in model.calls if ids[: len(c[0])] == c[0]), key=lambda c: len(c[0]))
        first, second = mine[0], mine[-1]
        assert second[0][: len(first[0]) + len(first[1].output_tokens)] == first[0] + first[1].output_tokens
        assert ids == second[0] + second[1].output_tokens
        glue = len(second[0]) - len(first[0]) - len(first[1].output_tokens)
        assert "is wrong. What is" in tokenizer.decode(second[0][len(second[0]) - glue :])
        assert mask == [0] * len(first[0]) + [1] * len(first[1].output_tokens) + [0] * glue + [1] * (n - len(second[0]))
        assert batch["logprobs"][i, n - 1].item() == -0.25 and batch["versions"][i, n - 1].item() == 3
    stats = stats_tracker.get("oe").export()
    assert stats["oe/openenv/turns"] == 2.0 and stats["oe/openenv/done"] == 1.0 and stats["oe/openenv/return"] == 0.5
    assert stats["oe/agent_extend"] == 1.0 and stats["oe/agent_repair"] == 0.0
    assert {kind for kind, _ in notes.failures} == {"environment failed"} and len(notes.failures) == 2
    assert notes.failures[0][1].startswith(f"openenv {server.url}: step: "), notes.failures[0][1]
    assert not _env_servers(f"--port {server.port}")


@pytest.mark.slow
def test_two_grpo_steps_with_the_environment_server_the_launcher_starts(
    oe_python: str, tiny_model_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """The launcher starts the environment server (its log in the run directory), every episode's model calls go
    through the agent proxy to the session's server, the environment rewards each reply, the held-out seeds are
    evaluated, and no environment server is left after the run."""
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/openenv_grpo.py"]
    cmd += ["--config", "examples/openenv_grpo.yaml", f"actor.engine.path={tiny_model_dir}"]
    cmd += [f"cluster.fileroot={tmp_path}", f"openenv.python={oe_python}", "openenv.train_size=16"]
    cmd += ["openenv.test_size=4", "total_train_steps=2", "train_dataset.batch_size=4", "gconfig.n_samples=2"]
    cmd += ["gconfig.max_new_tokens=8", "evaluator.freq_steps=2"]
    cmd += ["rollout.max_head_offpolicyness=0", *running_server.overrides]
    env = {**ENV, **running_server.env}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[launcher] openenv server healthy: http://127.0.0.1:" in proc.stdout
    log_dir = tmp_path / "logs" / "openenv-grpo" / "trial0"
    assert (log_dir / "openenv-server.log").is_file()
    steps = [json.loads(line) for line in (log_dir / "stats.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:  # a wrong first answer gets a second try: 1 or 2 replies, each a proxied call
        assert 1.0 <= s["rollout/openenv/turns"] <= 2.0 and s["rollout/agent_calls"] == s["rollout/openenv/turns"]
        assert s["rollout/openenv/done"] == 1.0 and s["rollout/group_dropped"] == 0.0
    assert "eval-rollout/openenv/return" in steps[-1], sorted(steps[-1])
    served = [p for p in running_server.requests() if p == "/inference/v1/generate"]
    turns = sum(s["rollout/openenv/turns"] for s in steps) * 4 * 2
    assert len(served) >= turns, (len(served), turns)
    assert not _env_servers(APP), [p.info["cmdline"] for p in _env_servers(APP)]
