"""verifiers environments in tandemrl (docs/environments.md, "verifiers"): the real verifiers 0.4 package in its own
virtualenv (``.venv-verifiers-test``, built by tests/side_venv.py on first use: verifiers pins openai<3), the
environment process (tandemrl/workflows/verifiers_bridge.py), and GRPO steps on examples/verifiers_envs through the
launcher and the session's vLLM server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from side_venv import side_venv
from utils import REPO_ROOT
from vllm_server import RunningServer

from tandemrl.configs.verifiers import VerifiersConfig
from tandemrl.workflows.verifiers import VERIFIERS_VERSION, VerifiersEnv, ensure_task_rows, task_rows

ENVS = str(REPO_ROOT / "examples" / "verifiers_envs")
ENV = {**os.environ, "WANDB_SILENT": "true", "TANDEMRL_DIST_TIMEOUT": "300", "PYTHONPATH": str(REPO_ROOT)}


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
