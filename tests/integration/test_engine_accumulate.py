"""``BaseTrainEngine.accumulate_gradients`` + ``apply_gradients`` (what tinker-serve's ``forward_backward`` and
``optim_step`` run): a batch trained in two halves, each weighted by the whole batch's tokens, then a step,
gives the weights of ``train_batch`` on the whole batch, over two steps (FSDP2, fp32, one rank); and
``set_optimizer_params`` replaces the Adam parameters, clipping and schedule an engine was built with."""

from __future__ import annotations

import pytest
import torch
from utils import REPO_ROOT, run_torchrun


@pytest.fixture(scope="module")
def weights(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the worker for both tests (one torchrun, four engines)."""
    out = tmp_path_factory.mktemp("accumulate") / "weights.pt"
    run_torchrun(REPO_ROOT / "tests" / "engine_accumulate_worker.py", 1, [tiny_model_dir, out])
    return torch.load(out)


def test_two_accumulated_halves_then_one_step_equal_one_train_batch(weights: dict) -> None:
    one, two, initial = weights["train_batch"], weights["accumulate"], weights["initial"]
    assert one.keys() == two.keys() == initial.keys() and one
    assert max(float((one[k] - initial[k]).abs().max()) for k in one) > 1e-3  # the step moved the weights
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert diff < 1e-6, diff


def test_set_optimizer_params_replaces_the_built_adam_clipping_and_schedule(weights: dict) -> None:
    """An engine built with another lr, beta2, eps, weight decay, clipping norm and a linear decay, then given the
    reference engine's parameters by ``set_optimizer_params``, trains two steps to the same weights."""
    ref, got = weights["accumulate"], weights["params"]
    diff = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    assert diff < 1e-6, diff
