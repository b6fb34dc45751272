"""Issue 13's done-when: a new algorithm written in a test file as one class (REINFORCE with a
group-mean baseline and an entropy bonus, tests/workers/new_algorithm_checks.py) takes 2 training
steps on FSDP2, DeepSpeed ZeRO-3 and Megatron (TP=2) with no per-backend class: each engine comes
from its backend's registry row and the same algorithm class drives it. On the same engines, the LR
schedule advances once per trainer step by itself, also when PPO takes 2 optimizer steps in one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from utils import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "new_algorithm_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}
EXPECTED = {"fsdp": "FSDPEngine", "deepspeed-zero3": "DeepSpeedEngine", "megatron-t2": "MegatronEngine"}


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("new_algorithm")
    run_torchrun(WORKER, 2, ["--model", tiny_model_dir, "--out", out], env=ENV, timeout=600)
    return torch.load(out / "new_algorithm.pt", weights_only=False)


@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_one_class_trains_on_every_backend(results: dict[str, dict], backend: str) -> None:
    res = results[backend]
    assert res["engine"] == EXPECTED[backend]  # built by the registry row, no per-backend algorithm class
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"]), res["losses"]
    assert res["n_weights"] > 0 and res["max_weight_change"] > 1e-6, res


def test_backends_agree_on_the_first_loss(results: dict[str, dict]) -> None:
    """Same weights, batch and loss: the first step's loss does not depend on the backend."""
    first = [results[b]["losses"][0] for b in sorted(EXPECTED)]
    assert first == pytest.approx([first[0]] * len(first), rel=1e-4)


# The worker's schedule by hand: lr 1e-3 over 4 trainer steps, linear warmup from 0 over the first
# int(0.5 * 4) = 2 (step k < 2: (k + 1) / 3 of lr), then cosine from lr down to 0.2 * lr over the 2 left
# (step k >= 2: 0.2 + 0.8 * (1 + cos(pi * (k - 2) / 2)) / 2 of lr: 1.0, then 0.6).
HAND_LRS = [[1e-3 / 3], [2e-3 / 3], [1e-3, 1e-3], [6e-4, 6e-4]]


@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_lr_schedule_advances_once_per_trainer_step_inside_the_engine(results: dict[str, dict], backend: str) -> None:
    """Two one-step REINFORCE updates, then two PPO updates of 2 minibatches each, and nobody steps the
    schedule: every optimizer step trains at the hand-computed lr of its trainer step, both minibatches
    of a PPO step at the same one."""
    lrs = results[backend]["lrs"]
    assert [len(step) for step in lrs] == [1, 1, 2, 2], lrs
    assert lrs == [pytest.approx(step, rel=1e-6) for step in HAND_LRS], lrs
