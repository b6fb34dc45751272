"""Tinker clients besides the lock's SDK against one real ``tandemrl tinker-serve`` on the tiny model and a real
LoRA-enabled vLLM server (docs/tinker.md, "Supported SDK versions" and "tinker-cookbook"): the oldest SDK the
server claims and the lock's (newest), one just below the range, and a tinker-cookbook recipe. Each other SDK
runs in its own virtualenv that the test builds once per machine (tests/side_venv.py: pip from the package index,
then reused offline)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from side_venv import side_venv
from test_tinker_serve import Tinker, _tinker_serve
from utils import REPO_ROOT
from vllm_server import Vllm

from tandemrl.tinker.sdk_range import NEWEST, OLDEST

pytestmark = pytest.mark.slow
# The release just below OLDEST: it fails save_weights_and_get_sampling_client (it asserts that the reply has no path).
BELOW = "0.19.0"
COOKBOOK = ["tinker-cookbook[math-rl]==0.5.8", f"tinker=={NEWEST}", "torch==2.13.0+cpu"]
PROGRAM = REPO_ROOT / "tests" / "tinker_sdk_program.py"


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: str,
    lora_vllm: Vllm,  # the session's LoRA vLLM server (conftest)
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Tinker]:
    tmp = tmp_path_factory.mktemp("tinker-compat")
    lora_vllm.restore_base()
    with _tinker_serve(tiny_model_dir, lora_vllm, tmp, "--max-adapters", "3") as t:
        yield t


def _sdk_python(version: str) -> str:
    """The lock's SDK is the main environment's; any other version gets a virtualenv of its own."""
    return sys.executable if version == NEWEST else str(side_venv(f"tinker-{version}", [f"tinker=={version}"]))


def _run(python: str, served: Tinker, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args`` with the server's URL and key in its environment and nothing of the repo's on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TINKER_BASE_URL=served.url, TINKER_API_KEY=served.key, TINKER_TELEMETRY="0")
    return subprocess.run([python, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_the_oldest_and_newest_claimed_sdk_train_and_sample(served: Tinker, version: str) -> None:
    """tests/tinker_sdk_program.py with that SDK version: two cross_entropy steps (the second loss is lower),
    save_weights_and_get_sampling_client and a greedy sample of 1 to 4 tokens."""
    proc = _run(_sdk_python(version), served, str(PROGRAM), served.base)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["version"] == version
    first, second = out["losses"]
    assert math.isfinite(first) and second < first, out
    assert 1 <= len(out["tokens"]) <= 4, out


def test_an_sdk_below_the_range_gets_one_line_naming_it(served: Tinker) -> None:
    """The SDK 0.19.0 fails at its first request (``ServiceClient()``) with tinker.BadRequestError and the
    server's one line; it created no training client."""
    before = _run_count(served)
    proc = _run(_sdk_python(BELOW), served, str(PROGRAM), served.base)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"ERROR BadRequestError: tinker SDK {BELOW} is outside the versions tinker-serve supports ({OLDEST} to "
        f"{NEWEST}); pip install 'tinker>={OLDEST},<={NEWEST}'"
    ]
    assert _run_count(served) == before


def test_a_newer_sdk_is_served_with_one_warning_line_in_the_server_log(served: Tinker) -> None:
    """Requests naming SDK 0.99.0 (its version header) are answered; the log has one warning line for it."""
    url, key = served.url + "/api/v1/get_server_capabilities", {"X-API-Key": served.key}
    for _ in range(2):
        r = requests.get(url, headers={**key, "X-Stainless-Package-Version": "0.99.0"}, timeout=60)
        assert r.status_code == 200 and r.json()["supported_models"], r.text
    old = requests.get(url, headers={**key, "User-Agent": f"Tinker/Python {BELOW}"}, timeout=60)
    assert old.status_code == 400 and old.text.startswith(f"tinker SDK {BELOW} is outside"), old.text
    log = (served.out.parent / "tinker.log").read_text()
    warnings = [line for line in log.splitlines() if "tinker SDK 0.99.0 is newer" in line]
    assert len(warnings) == 1 and warnings[0].endswith(f"({OLDEST} to {NEWEST}); serving it anyway"), warnings


def _run_count(served: Tinker) -> int:
    r = requests.get(served.url + "/api/v1/training_runs", headers={"X-API-Key": served.key}, timeout=60)
    r.raise_for_status()
    return int(r.json()["cursor"]["total_count"])


def test_cookbook_sl_loop_trains_three_steps_on_local_data(served: Tinker, gsm8k_dir: str, tmp_path: Path) -> None:
    """tinker-cookbook 0.5.8's sl_loop recipe (tests/cookbook_recipe.py: the model's own tokenizer, the
    qwen3_instruct renderer checked against its chat template, 32 GSM8K questions and answers as the chat data)
    runs 3 steps of 4 conversations: 3 metric lines with a finite train NLL, then its final checkpoint, whose
    sampler weights are on the server's disk."""
    data = tmp_path / "chat.jsonl"
    with open(Path(gsm8k_dir) / "train.jsonl") as f, open(data, "w") as out:
        for line in list(f)[:32]:
            row = json.loads(line)
            messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
            out.write(json.dumps({"messages": messages}) + "\n")
    args = [f"model_name={served.base}", f"base_url={served.url}", f"log_path={tmp_path / 'run'}", "batch_size=4"]
    args += ["max_steps=3", "lora_rank=4", "max_length=256", "learning_rate=1e-3", "save_every=0"]
    python = str(side_venv("cookbook-0.5.8", COOKBOOK))
    proc = _run(
        python, served, str(REPO_ROOT / "tests" / "cookbook_recipe.py"), "sl_loop", str(data), *args, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Using renderer: qwen3_instruct" in proc.stderr + proc.stdout
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["num_sequences"] == 4 for m in metrics), metrics
    assert all(math.isfinite(m["train_mean_nll"]) and m["train_mean_nll"] > 0 for m in metrics), metrics
    (final,) = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert final["name"] == "final" and final["sampler_path"].endswith("/sampler_weights/final"), final
    sampler_dir = served.out / final["sampler_path"].removeprefix("tinker://")
    assert (sampler_dir / "adapter_model.safetensors").is_file()
