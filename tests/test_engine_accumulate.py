"""``BaseTrainEngine.accumulate_gradients`` + ``apply_gradients`` (what tinker-serve's ``forward_backward`` and
``optim_step`` run): a batch trained in two halves, each weighted by the whole batch's tokens, then one step,
gives the weights of one ``train_batch`` on the whole batch (FSDP2, fp32, one rank)."""

from __future__ import annotations

from pathlib import Path

import torch
from utils import REPO_ROOT, run_torchrun


def test_two_accumulated_halves_then_one_step_equal_one_train_batch(tiny_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    run_torchrun(REPO_ROOT / "tests" / "engine_accumulate_worker.py", 1, [tiny_model_dir, out])
    weights = torch.load(out)
    one, two, initial = weights["train_batch"], weights["accumulate"], weights["initial"]
    assert one.keys() == two.keys() == initial.keys() and one
    assert max(float((one[k] - initial[k]).abs().max()) for k in one) > 1e-3  # the step moved the weights
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert diff < 1e-6, diff
