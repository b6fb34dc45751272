"""Deterministic mode end to end: two identical GRPO runs through the local launcher agree bitwise.

The run is the GRPO example with a dense reward (``tests/workers/grpo_dense_reward.py``), so the
weights move. One launch sweeps ``async_training=false,true`` x two trial names: four trials, each with its own
trainer, run one after the other on one vLLM server that this test starts with whole prefills (as the launcher
would for a deterministic run) and names in ``rollout.server_addrs``; each trial first pushes its initial
weights there (and every update drops the prefix cache), so no trial sees another's state. Each pair (same mode, same seed and config)
must log the same scalars (losses, rewards, lengths, ...; timings excluded) and save the same
final weights, bit for bit; sync and async must differ (the comparison can fail).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_launcher import _grpo_args, _run, _scalars
from utils import REPO_ROOT
from vllm_server import TOKEN_ENV, RunningServer, launch_test_server

from tandemrl.inference.server_auth import new_token
from tandemrl.inference.vllm import DETERMINISTIC_SERVER_FLAGS

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from determinism_digest import TIMING, weights_digest  # noqa: E402 - scripts/ is no package

STEPS = 3


def _deterministic_scalars(tb_dir: Path) -> dict[str, list[float]]:
    return {k: v for k, v in _scalars(tb_dir).items() if not any(t in k for t in TIMING)}


@pytest.fixture
def whole_prefill_server(tiny_model_dir: str, tmp_path: Path) -> Iterator[RunningServer]:
    """A vLLM server on the tiny model started with ``DETERMINISTIC_SERVER_FLAGS`` (the session server splits
    prefills), for the launches' ``rollout.server_addrs``."""
    token = os.environ.setdefault(TOKEN_ENV, new_token())  # keep the session server's token if it set one
    requests = tmp_path / "vllm.requests.jsonl"
    requests.touch()
    proc = launch_test_server(
        tiny_model_dir, str(tmp_path / "vllm.log"), token, str(requests), **DETERMINISTIC_SERVER_FLAGS
    )
    try:
        proc.wait_healthy(900.0)
        yield RunningServer([f"rollout.server_addrs=[{proc.address}]"], {TOKEN_ENV: token}, requests, 0)
    finally:
        proc.stop()


@pytest.mark.slow
def test_grpo_deterministic_runs_are_bitwise_identical(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, whole_prefill_server: RunningServer
) -> None:
    args = _grpo_args(
        "tests/workers/grpo_dense_reward.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=STEPS, new_tokens=16
    )
    sweep = ["--multirun", "async_training=false,true", "trial_name=a,b"]
    # The example's own batch (8 prompts x 4 samples: 32 seeded requests at once, whose prefills vLLM would
    # otherwise chunk on CPU and crash rewinding their generators; deterministic runs start it with whole prefills).
    extra = ["deterministic=true"]
    proc = _run([*args, *extra, *sweep], timeout=1800, server=whole_prefill_server)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "/inference/v1/generate" in whole_prefill_server.requests()  # the trials generated on that server
    runs: dict[tuple[str, str], tuple[dict[str, list[float]], str]] = {}
    for mode in ("false", "true"):
        for name in ("a", "b"):
            trial = f"{name}_async_training{mode}_trial_name{name}"
            stats = _deterministic_scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / trial)
            assert len(stats["actor/ppo_actor/update/loss"]) == STEPS and len(stats["rollout/reward"]) == STEPS, trial
            assert min(stats["rollout/reward"]) > 0.0, (trial, stats["rollout/reward"])
            # The weight version behind each step's tokens is fixed: sync is on-policy; async step s > 0
            # trains on the batch generated whole by version s - 1 (never interrupted by an update).
            expected = [0.0, 1.0, 2.0] if mode == "false" else [0.0, 0.0, 1.0]
            assert stats["rollout_version_min"] == expected == stats["rollout_version_max"], (trial, stats)
            assert stats["actor/ppo_actor/offpolicy/multi_version_tokens"] == [0.0] * STEPS, trial
            if mode == "true":
                assert stats["rollout/staleness/max"] == [0.0, 1.0, 1.0] == stats["rollout/staleness/min"], trial
            ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / trial / f"epoch0epochstep{STEPS - 1}globalstep{STEPS - 1}"
            runs[(mode, name)] = (stats, weights_digest(ckpt))
            assert runs[(mode, name)][1] != weights_digest(Path(tiny_model_dir)), f"{trial}: training left the weights"
    for mode in ("false", "true"):
        (stats_a, weights_a), (stats_b, weights_b) = runs[(mode, "a")], runs[(mode, "b")]
        assert sorted(stats_a) == sorted(stats_b), mode
        differing = {k: (stats_a[k], stats_b[k]) for k in stats_a if stats_a[k] != stats_b[k]}
        assert not differing, (mode, differing)
        assert weights_a == weights_b, f"async_training={mode}: final weights differ"
    # Negative control: the same comparison tells the two modes apart (different data, different weights).
    (sync, sync_w), (async_, async_w) = runs[("false", "a")], runs[("true", "a")]
    assert sync_w != async_w
    loss = "actor/ppo_actor/update/loss"
    assert sync[loss][1:] != async_[loss][1:]
    # Seeds follow the row and the rollout, not the mode or timing: step 0 (batch 0, version 0) is the same.
    assert sync[loss][0] == async_[loss][0]
