"""Tinker's built-in losses (tandemrl/algorithms/tinker_losses.py) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.algorithms.tinker_losses import check_config, loss_inputs_needed, tinker_loss

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


# gspo on a 3-token datum: a prompt position (advantage 0, sampler logprob 0) and two sampled ones.
LOGP3 = [math.log(0.5), math.log(0.25), math.log(0.5)]
OLD3 = torch.tensor([0.0, math.log(0.25), math.log(0.25)])  # log-ratios of the sampled positions: 0 and log 2


def _gspo(adv: list[float], config: dict[str, float] | None = None, **extra: torch.Tensor) -> tuple[list, list]:
    logp = torch.tensor(LOGP3, requires_grad=True)
    out = tinker_loss("gspo", logp, {"advantages": torch.tensor(adv), "logprobs": OLD3, **extra}, config)
    out.sum().backward()
    assert logp.grad is not None
    return out.tolist(), logp.grad.tolist()


def test_gspo_uses_one_length_normalised_sequence_ratio_for_every_token() -> None:
    # Default mask: the positions with a non-zero advantage (1 and 2); s = exp((0 + log 2) / 2) = sqrt(2).
    s = math.sqrt(2)
    loss, grad = _gspo([0.0, 1.0, 3.0], {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert loss == pytest.approx([0.0, -s, -3 * s])
    # Token t's gradient is -s * A_t, through its own logp only; through the sequence ratio it would be
    # -(1 + 3) * s / 2 = -2 * s on both sampled tokens.
    assert grad == pytest.approx([0.0, -s, -3 * s])


def test_gspo_clips_the_sequence_ratio_with_ppos_thresholds() -> None:
    s = math.sqrt(2)
    loss, grad = _gspo([0.0, 1.0, 3.0])  # defaults 0.8 / 1.2: s = 1.41 is clipped to 1.2 for A > 0
    assert loss == pytest.approx([0.0, -1.2, -3.6])
    assert grad == pytest.approx([0.0, 0.0, 0.0])  # the clipped term carries no gradient
    loss, grad = _gspo([0.0, -1.0, -1.0])  # A < 0: min(-s, -1.2) = -s, unclipped
    assert loss == pytest.approx([0.0, s, s])
    assert grad == pytest.approx([0.0, s, s])


def test_gspo_takes_the_ratio_over_sequence_ratio_mask_when_given() -> None:
    mask = torch.tensor([0.0, 0.0, 1.0])  # only position 2: s = exp(log 2) = 2
    loss, _ = _gspo([0.0, 1.0, 3.0], {"clip_high_threshold": 3.0}, sequence_ratio_mask=mask)
    assert loss == pytest.approx([0.0, -2.0, -6.0])


def test_refused_losses_and_unknown_config_keys_fail_in_one_line() -> None:
    for name, reason in [
        ("stable_reinforce", "Tinker does not publish its objective"),
        ("custom", "it runs a loss uploaded with create_custom_loss"),
    ]:
        with pytest.raises(ValueError, match=f"loss_fn: '{name}' is not served by tinker-serve: {reason}") as err:
            tinker_loss(name, LOGP, {"advantages": ADV, "logprobs": OLD})
        assert "\n" not in str(err.value)
    with pytest.raises(
        ValueError, match=r"loss_fn_config: unknown key 'clip_eps' for loss 'gspo' \(it takes: clip_low"
    ):
        check_config("gspo", ["clip_low_threshold", "clip_eps"])
    with pytest.raises(ValueError, match=r"unknown key 'beta' for loss 'cross_entropy' \(it takes none\)"):
        check_config("cross_entropy", ["beta"])
    check_config("dro", ["beta"])
