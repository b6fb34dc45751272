"""The reasoning-gym job (examples/reasoning_gym_grpo.py) through the local launcher on the tiny model: the rows
are generated before any process starts, three GRPO steps run with the task's verifier as the reward (no call
fails), and the held-out scores are those of the generated test split."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from utils import launch
from vllm_server import RunningServer

pytestmark = pytest.mark.slow


def _launch(overrides: list[str], timeout: float, server: RunningServer) -> subprocess.CompletedProcess[str]:
    args = ["examples/reasoning_gym_grpo.py", "--config", "examples/gsm8k_grpo.yaml", *overrides]
    return launch(args, timeout, server=server)


def test_three_steps_with_the_task_verifier_as_reward(
    tiny_model_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    data = tmp_path / "data" / "rg"
    proc = _launch(
        [
            f"actor.engine.path={tiny_model_dir}",
            f"cluster.fileroot={tmp_path}",
            f"train_dataset.path={data}",
            "train_dataset.reasoning_gym.tasks=[{name: chain_sum, config: {max_terms: 3, max_digits: 2}}]",
            "train_dataset.reasoning_gym.size=200",
            "train_dataset.reasoning_gym.test_size=20",
            "total_train_steps=3",
            "gconfig.max_new_tokens=16",
            "valid_dataset.max_samples=8",
            "evaluator.freq_steps=3",
            "heldout_eval.n=4",
            "heldout_eval.max_new_tokens=8",
        ],
        timeout=900,
        server=running_server,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    spec = json.loads((data / "reasoning_gym.json").read_text())
    assert [t["name"] for t in spec["tasks"]] == ["chain_sum"] and spec["size"] == 200
    log_dir = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    steps = [json.loads(line) for line in (log_dir / "stats.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    # every reward call of every step reached the verifier with the row's entry (a failure counts 1 here)
    assert [s["rollout/reward_failed"] for s in steps] == [0.0, 0.0, 0.0], steps[-1].keys()
    test = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    for tag in ("before", "after"):
        report = json.loads((log_dir / f"heldout_{tag}.json").read_text())
        assert [q["gold"] for q in report["questions"]] == [row["answer"] for row in test[:4]]
