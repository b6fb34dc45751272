"""Tinker's built-in losses (tandemrl/algorithms/tinker_losses.py) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.algorithms.tinker_losses import loss_inputs_needed, tinker_loss

LOGP = torch.tensor([math.log(0.5), math.log(0.25)])
OLD = torch.tensor([math.log(0.25), math.log(0.5)])  # ratios exp(logp - old): 2.0 and 0.5
ADV = torch.tensor([1.0, -2.0])


def test_cross_entropy_is_the_weighted_negative_logprob() -> None:
    out = tinker_loss("cross_entropy", LOGP, {"weights": torch.tensor([1.0, 0.0])})
    assert out.tolist() == pytest.approx([math.log(2), 0.0])


def test_importance_sampling_is_minus_ratio_times_advantage() -> None:
    out = tinker_loss("importance_sampling", LOGP, {"advantages": ADV, "logprobs": OLD})
    assert out.tolist() == pytest.approx([-2.0, 1.0])  # -(2 * 1), -(0.5 * -2)


def test_ppo_takes_the_pessimistic_clipped_term() -> None:
    out = tinker_loss("ppo", LOGP, {"advantages": ADV, "logprobs": OLD})
    # token 0: min(2*1, 1.2*1) = 1.2; token 1: min(0.5*-2, 0.8*-2) = -1.6
    assert out.tolist() == pytest.approx([-1.2, 1.6])
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}
    assert tinker_loss("ppo", LOGP, {"advantages": ADV, "logprobs": OLD}, cfg).tolist() == pytest.approx([-2.0, 1.0])


def test_cispo_weights_logp_by_the_clipped_ratio_without_its_gradient() -> None:
    logp = LOGP.clone().requires_grad_(True)
    out = tinker_loss("cispo", logp, {"advantages": ADV, "logprobs": OLD})
    assert out.tolist() == pytest.approx([-1.2 * math.log(0.5), 1.6 * math.log(0.25)])  # -clip(r) * A * logp
    out.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-1.2, 1.6])  # -clip(r) * A: no gradient through the ratio


def test_dro_is_reward_term_minus_quadratic_penalty() -> None:
    out = tinker_loss("dro", LOGP, {"advantages": ADV, "logprobs": OLD}, {"beta": 0.5})
    d = math.log(2)  # |logp - old| on both tokens
    assert out.tolist() == pytest.approx([-(math.log(0.5) - 0.25 * d * d), -(-2 * math.log(0.25) - 0.25 * d * d)])


def test_unknown_loss_and_bad_clip_fail_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"loss_fn: unknown loss 'nope' \(one of: cross_entropy"):
        loss_inputs_needed("nope")
    with pytest.raises(ValueError, match="clip_low_threshold"):
        tinker_loss("ppo", LOGP, {"advantages": ADV, "logprobs": OLD}, {"clip_low_threshold": 1.5})
