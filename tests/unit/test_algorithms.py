"""Pure RL tensor functions against hand-computed values (padded and packed layouts, masks)."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.algorithms import (
    aggregate_loss,
    aggregation_weight,
    apply_no_eos_penalty,
    batch_normalized_advantages,
    entropy_bonus,
    gae,
    group_normalized_advantages,
    kl_estimate,
    kl_penalty_rewards,
    leave_one_out_advantages,
    normalization_stats,
    normalize_advantages,
    overlong_penalty,
    place_at_last_token,
    ppo_policy_loss,
    reinforce_loss,
    reject_uniform_rewards,
    remax_advantages,
    response_ends_with_eos,
    shape_rewards,
    value_loss,
)
from tandemrl.algorithms.layout import packed_to_padded, padded_to_packed, per_sequence_sum, shift_left

LN2 = math.log(2.0)


def t(*rows: object) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def close(x: torch.Tensor, expected: list) -> bool:
    return torch.allclose(x, torch.tensor(expected, dtype=x.dtype), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ layout
def test_layout_helpers() -> None:
    assert shift_left(t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])).tolist() == [[2.0, 3.0, 0.0], [5.0, 6.0, 0.0]]
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed = t([1.0, 2.0, 3.0, 4.0, 5.0])
    padded = packed_to_padded(packed, cu)
    assert padded.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    assert torch.equal(padded_to_packed(padded, cu), packed)
    assert per_sequence_sum(packed, cu).tolist() == [3.0, 12.0]


# ------------------------------------------------------------------------------------------------ GAE
def test_gae_hand_computed_with_prompt_mask() -> None:
    # Position 0 is a prompt position; gamma = lambda = 0.5.
    r, v, m = t([[0.0, 0.0, 0.0, 1.0]]), t([[0.5, 1.0, 2.0, 3.0]]), torch.tensor([[0, 1, 1, 1]]).bool()
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.5)
    # t3: 1 - 3 = -2; t2: 0 + .5*3 - 2 + .25*(-2) = -1; t1: 0 + .5*2 - 1 + .25*(-1) = -0.25
    assert close(adv, [[0.0, -0.25, -1.0, -2.0]])
    assert close(ret, [[0.0, 0.75, 1.0, 1.0]])


def test_gae_skips_unmasked_positions_and_ignores_their_rewards() -> None:
    r, v, m = t([[0.0, 5.0, 1.0]]), t([[1.0, 100.0, 2.0]]), torch.tensor([[1, 0, 1]]).bool()
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    # t2: 1 - 2 = -1; t0 bootstraps from the next *masked* value (2): 0 + 2 - 1 + (-1) = 0
    assert close(adv, [[0.0, 0.0, -1.0]])
    assert close(ret, [[1.0, 0.0, 1.0]])


def test_gae_packed_equals_padded() -> None:
    r = t([0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0])
    v = t([0.5, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0])
    m = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]).bool()
    adv, ret = gae(r, v, m, 0.5, 0.5)
    # Row 1: t2: 2; t1: 0 + .25*2 = .5; t0: .25*.5 = .125
    assert adv[1].tolist() == pytest.approx([0.125, 0.5, 2.0, 0.0])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    lens = [4, 3]
    pack = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lens)])  # noqa: E731
    adv_p, ret_p = gae(pack(r), pack(v), pack(m), 0.5, 0.5, cu_seqlens=cu)
    assert torch.allclose(adv_p, pack(adv)) and torch.allclose(ret_p, pack(ret))


# ------------------------------------------------------------------------------------------------ baselines
def test_grpo_and_dr_grpo() -> None:
    r = t([1.0, 0.0, 0.0, 0.0])
    a = 0.5 / (math.sqrt(0.5) + 1e-5)  # group [1, 0]: mean .5, unbiased std sqrt(.5)
    assert group_normalized_advantages(r, 2).tolist() == pytest.approx([a, -a, 0.0, 0.0])
    b = 0.5 / (0.5 + 1e-5)  # biased std .5
    assert group_normalized_advantages(r, 2, unbiased=False).tolist() == pytest.approx([b, -b, 0.0, 0.0])
    assert group_normalized_advantages(r, 2, use_std=False).tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_rloo_leave_one_out() -> None:
    # Baselines: (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5; second group (0, 0, 3): 1.5, 1.5, 0
    adv = leave_one_out_advantages(t([1.0, 2.0, 6.0, 0.0, 0.0, 3.0]), 3)
    assert adv.tolist() == pytest.approx([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])


def test_reinforce_pp_batch_norm_over_masked_tokens() -> None:
    adv = t([1.0, 2.0, 9.0], [3.0, 7.0, 7.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    # Tokens 1, 2, 3: mean 2, unbiased std 1.
    out = batch_normalized_advantages(adv, mask)
    s = 1.0 + 1e-5
    assert close(out, [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]])


def test_remax() -> None:
    assert remax_advantages(t([1.0, 0.0]), t([0.5, 0.5])).tolist() == [0.5, -0.5]
    with pytest.raises(ValueError, match="greedy"):
        remax_advantages(t([1.0, 0.0]), t([0.5]))


def test_batch_statistics_go_through_all_reduce() -> None:
    # Two "ranks" holding the same rows [1, 3]: global data [1, 3, 1, 3], mean 2, unbiased var 4/3.
    x, m = t([1.0, 3.0]), torch.ones(2, dtype=torch.bool)
    calls = []

    def doubled(v: torch.Tensor) -> torch.Tensor:
        calls.append(v.shape)
        return v * 2

    base, scale = normalization_stats(x, m, mean_level="batch", std_level="batch", eps=0.0, all_reduce=doubled)
    assert base.tolist() == [2.0, 2.0]
    assert scale.tolist() == pytest.approx([math.sqrt(4 / 3)] * 2)
    assert len(calls) == 3  # mean (sum, count) for each level, then the squared deviations
    local = normalization_stats(x, m, mean_level="batch", std_level="batch", eps=0.0)[1]
    assert local.tolist() == pytest.approx([math.sqrt(2.0)] * 2)


def test_normalizer_validates_levels_and_groups() -> None:
    x, m = t([1.0, 2.0, 3.0]), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mean_level"):
        normalize_advantages(x, m, mean_level="global")
    with pytest.raises(ValueError, match="groups of 2"):
        normalize_advantages(x, m, group_size=2, mean_level="group")


# ------------------------------------------------------------------------------------------------ rewards
def test_reward_shaping() -> None:
    assert shape_rewards(t([1.0, -30.0, 5.0]), scaling=2.0, bias=1.0, clip=10.0).tolist() == [4.0, -10.0, 10.0]
    # max_len 16, buffer 4: no penalty up to 12, linear to -1 at 16, -1 beyond.
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_len=16, buffer=4, factor=1.0)
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer=0)


def test_eos_detection_and_penalty() -> None:
    ids = torch.tensor([[5, 7, 2, 0], [5, 7, 8, 0], [5, 2, 9, 9]])
    lm = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    ended = response_ends_with_eos(ids, lm, [2])
    assert ended.tolist() == [True, False, False]
    assert apply_no_eos_penalty(t([1.0, 1.0, 0.5]), ended, -1.0).tolist() == [1.0, -1.0, -1.0]


def test_place_at_last_token() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]]).bool()
    out = place_at_last_token(t([3.0, 4.0, 5.0]), mask)
    assert out.tolist() == [[0.0, 0.0, 3.0, 0.0], [0.0] * 4, [0.0, 0.0, 5.0, 0.0]]


# ------------------------------------------------------------------------------------------------ KL
def test_kl_estimators() -> None:
    logp, ref = t([math.log(0.5), math.log(0.25)]), t([math.log(0.25), math.log(0.5)])  # d = [ln2, -ln2]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([LN2, -LN2])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([LN2**2 / 2] * 2)
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.5 - 1 + LN2, 2 - 1 - LN2])
    rew = kl_penalty_rewards(logp, ref, torch.tensor([True, False]), coef=0.1)
    assert rew.tolist() == pytest.approx([-0.1 * LN2, 0.0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


# ------------------------------------------------------------------------------------------------ policy loss
def _ratios(*rs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp) whose ratios are ``rs``."""
    return torch.tensor([math.log(r) for r in rs], requires_grad=True), torch.zeros(len(rs))


def test_ppo_clip_asymmetric_and_dual() -> None:
    logp, old = _ratios(1.5, 0.5, 1.1, 2.0)
    adv, mask = t([1.0, 1.0, -1.0, -1.0]), torch.ones(4, dtype=torch.bool)
    # Per token: max(-A r, -A clip(r, .8, 1.2)) = [-1.2 (clipped), -0.5, 1.1, 2.0]
    loss, st = ppo_policy_loss(logp, old, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(1.4 / 4)
    assert st["clip_mask"].tolist() == [True, False, False, False]
    loss.backward()
    # Clipped token: no gradient; others d/dlogp = -A * r / 4.
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 2.0 / 4])
    # Clip-higher 0.6: r = 1.5 is inside [0.8, 1.6].
    loss, st = ppo_policy_loss(*_ratios(1.5, 0.5, 1.1, 2.0), adv, mask, eps_clip=0.2, eps_clip_higher=0.6)
    assert loss.item() == pytest.approx(1.1 / 4) and not st["clip_mask"].any()
    # Dual clip c = 1.5 caps the A < 0, r = 2 token at 1.5.
    loss, st = ppo_policy_loss(*_ratios(1.5, 0.5, 1.1, 2.0), adv, mask, eps_clip=0.2, c_clip=1.5)
    assert loss.item() == pytest.approx(0.9 / 4)
    assert st["dual_clip_mask"].tolist() == [False, False, False, True]
    assert st["approx_kl"].tolist() == pytest.approx([-math.log(r) for r in (1.5, 0.5, 1.1, 2.0)])
    with pytest.raises(ValueError, match="c_clip"):
        ppo_policy_loss(*_ratios(1.0), t([1.0]), torch.ones(1, dtype=torch.bool), 0.2, c_clip=1.0)


def test_ppo_mask_excludes_tokens() -> None:
    logp, old = _ratios(1.5, 0.5, 1.1, 2.0)
    old = old.clone()
    old[3] = float("-inf")  # junk at a masked position must not leak (no NaN)
    mask = torch.tensor([True, True, True, False])
    loss, _ = ppo_policy_loss(logp, old, t([1.0, 1.0, -1.0, 5.0]), mask, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)


def test_decoupled_behaviour_weights_and_cap() -> None:
    logp, prox = _ratios(1.5, 0.5, 1.1, 2.0)
    behav = -torch.log(t([1.0, 2.0, 4.0, 8.0]))  # w = exp(prox - behav) = [1, 2, 4, 8]
    adv, mask = t([1.0, 1.0, -1.0, -1.0]), torch.ones(4, dtype=torch.bool)
    loss, st = ppo_policy_loss(logp, prox, adv, mask, 0.2, behav_logp=behav, behav_imp_weight_cap=5.0)
    # [-1.2 * 1, -0.5 * 2, 1.1 * 4, dropped]; the dropped token stays in the denominator.
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 4.4) / 4)
    assert st["behav_kept"].tolist() == [True, True, True, False]
    assert st["behav_imp_weight"].tolist() == pytest.approx([1.0, 2.0, 4.0, 0.0])


def test_gspo_sequence_ratio_packed_and_padded() -> None:
    # Sequence A: token log-ratios [ln2, 0] -> r = sqrt(2), A = +1; sequence B: r = 0.5, A = -1.
    lr = [LN2, 0.0, -LN2]
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    adv, mask = t([1.0, 1.0, -1.0]), torch.ones(3, dtype=torch.bool)
    kw = {"ratio_level": "sequence", "cu_seqlens": cu}
    loss, st = ppo_policy_loss(torch.tensor(lr), torch.zeros(3), adv, mask, 0.2, **kw)
    # Clipped: A: -1.2 per token; B: max(0.5, 0.8) = 0.8.
    assert loss.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)
    assert st["ratio"].tolist() == pytest.approx([math.sqrt(2)] * 2 + [0.5])
    smtm, _ = ppo_policy_loss(torch.tensor(lr), torch.zeros(3), adv, mask, 0.2, agg_mode="seq-mean-token-mean", **kw)
    assert smtm.item() == pytest.approx((-1.2 + 0.8) / 2)
    smts, _ = ppo_policy_loss(
        torch.tensor(lr), torch.zeros(3), adv, mask, 0.2, agg_mode="seq-mean-token-sum", agg_norm_len=2.0, **kw
    )
    assert smts.item() == pytest.approx((-2.4 / 2 + 0.8 / 2) / 2)
    # Unclipped: loss = (-2 r_A + r_B) / 3 and d r_A / d logp_t = r_A / 2 for both tokens of A.
    logp = torch.tensor(lr, requires_grad=True)
    ppo_policy_loss(logp, torch.zeros(3), adv, mask, 10.0, **kw)[0].backward()
    assert logp.grad.tolist() == pytest.approx([-math.sqrt(2) / 3] * 2 + [0.5 / 3])
    # Padded rows give the same loss.
    pad_lr = torch.tensor([[LN2, 0.0], [-LN2, 0.0]])
    pad_mask = torch.tensor([[True, True], [True, False]])
    pad_loss, _ = ppo_policy_loss(
        pad_lr, torch.zeros(2, 2), t([1.0, 1.0], [-1.0, 0.0]), pad_mask, 0.2, ratio_level="sequence"
    )
    assert pad_loss.item() == pytest.approx(loss.item())


def test_aggregation_weights_match_modes() -> None:
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    mask = torch.tensor([1, 1, 0, 0, 0, 1]).bool()
    assert aggregation_weight(mask, "token-mean", cu) == 3
    assert aggregation_weight(mask, "seq-mean-token-mean", cu) == 2  # the middle sequence has no tokens
    # Split a batch into two micro-batches: the weighted mean of their losses is the whole-batch loss.
    loss = t([1.0, 3.0, 9.0, 9.0, 9.0, 5.0])
    whole = aggregate_loss(loss, mask, "seq-mean-token-mean", cu)
    assert whole.item() == pytest.approx((2.0 + 5.0) / 2)
    a = aggregate_loss(loss[:3], mask[:3], "seq-mean-token-mean", cu[:2])
    b = aggregate_loss(loss[3:], mask[3:], "seq-mean-token-mean", cu[1:] - 3)
    wa, wb = (
        aggregation_weight(mask[:3], "seq-mean-token-mean", cu[:2]),
        aggregation_weight(mask[3:], "seq-mean-token-mean", cu[1:] - 3),
    )
    assert ((a * wa + b * wb) / (wa + wb)).item() == pytest.approx(whole.item())
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss, mask, "sum")


def test_entropy_and_reinforce() -> None:
    assert entropy_bonus(t([1.0, 3.0]), torch.tensor([True, False]), 0.1).item() == pytest.approx(-0.1)
    loss = reinforce_loss(t([-1.0, -2.0, -3.0]), t([1.0, -1.0, 2.0]), torch.tensor([True, True, False]))
    assert loss.item() == pytest.approx(-(1 * -1 + -1 * -2) / 2)


# ------------------------------------------------------------------------------------------------ value loss
def test_clipped_value_loss() -> None:
    v, old, ret, mask = t([1.0, 2.0]), t([0.5, 2.0]), t([2.0, 0.0]), torch.ones(2, dtype=torch.bool)
    # t0: (1-2)^2 = 1 vs clipped (0.7-2)^2 = 1.69 -> 1.69; t1: 4 either way.
    loss, st = value_loss(v, old, ret, mask, eps_clip_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert st["clip_mask"].tolist() == [True, False]
    assert value_loss(v, old, ret, mask)[0].item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)


# ------------------------------------------------------------------------------------------------ filters
def test_reject_uniform_rewards() -> None:
    assert reject_uniform_rewards({"rewards": t([1.0, 1.0])}) is False
    assert reject_uniform_rewards({"rewards": t([0.0, 1.0])}) is True
    assert reject_uniform_rewards({"rewards": t([1.0])}) is False
    with pytest.raises(KeyError, match="rewards"):
        reject_uniform_rewards({})


def test_reinforce_corrected_loss_hand_values() -> None:
    """``-w * A * logp`` token mean with ``w = min(exp(logp - behav), 2)`` detached; the masked third token
    and a dropped (mis, rho > 2) token add nothing but stay in the denominator."""
    from tandemrl.algorithms.offpolicy import Correction
    from tandemrl.algorithms.reinforce import reinforce_corrected_loss

    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    behav = torch.tensor([-1.0 - math.log(3.0), -2.0 + math.log(2.0), -9.0])
    adv, mask = torch.tensor([1.0, -1.0, 5.0]), torch.tensor([True, True, False])
    loss, w = reinforce_corrected_loss(logp, adv, mask, behav, Correction("tis", cap=2.0))
    # w = [min(3, 2), 0.5]; loss = -(2 * 1 * -1 + 0.5 * -1 * -2) / 2 = 0.5; d/dlogp = -w * A / 2
    assert loss.item() == pytest.approx(0.5) and w.tolist() == pytest.approx([2.0, 0.5, 0.0])
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.25, 0.0])
    loss, w = reinforce_corrected_loss(logp.detach(), adv, mask, behav, Correction("mis", cap=2.0))
    assert w.tolist() == pytest.approx([0.0, 0.5, 0.0]) and loss.item() == pytest.approx(-0.5)
    loss, w = reinforce_corrected_loss(logp.detach(), adv, mask, behav, Correction("none"))
    assert w.tolist() == [1.0, 1.0, 0.0] and loss.item() == pytest.approx((1.0 - 2.0) / 2)


def test_rloo_with_one_valid_sample_in_a_group_has_no_advantage() -> None:
    """Group 1 keeps one valid sample (the others masked, e.g. mask_no_eos): leave-one-out has no other
    sample to compare it with, so its advantage is 0, not its raw reward 1; group 2 is ordinary RLOO."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    valid = torch.tensor([True, False, False, True, True, True])
    baseline, _ = normalization_stats(rewards, valid, 3, "group", "none", leave_one_out=True)
    adv = torch.where(valid, rewards - baseline, 0.0)
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0, -0.5, -0.5])


def test_reinforce_actions_leave_out_forced_tokens() -> None:
    """ReMax/REINFORCE like PPO: a token of a constrained call with behaviour logprob exactly 0 is no action."""
    from tandemrl.algorithms.reinforce import reinforce_advantages

    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "attention_mask": torch.ones(1, 5).bool(),
        "loss_mask": torch.tensor([[0, 1, 1, 1, 1]]),
        "logprobs": torch.tensor([[0.0, -0.7, 0.0, 0.0, -0.2]]),
        "rewards": torch.tensor([2.0]),
    }
    adv, action = reinforce_advantages(batch)
    assert action.tolist() == [[True, True, True, True, False]]
    batch["constrained"] = torch.tensor([[0, 1, 1, 0, 1]])  # token 3's 0.0 is a free (greedy-like) choice
    adv, action = reinforce_advantages(batch)
    assert action.tolist() == [[True, False, True, True, False]] and adv.tolist() == [[2.0, 0.0, 2.0, 2.0, 0.0]]


def test_reinforce_weighs_a_constrained_choice_one() -> None:
    """The REINFORCE step compares a token a grammar limited (not forced) with its own forward, as PPO does
    (tests/unit/test_offpolicy.py): the server's constrained logprob log p(a) - log p(A) would weigh it p(A)."""
    from tandemrl.algorithms.offpolicy import Correction
    from tandemrl.algorithms.reinforce import _Loss

    logits = torch.zeros(4, 3)  # every token has log p = log 1/3 under the trainer
    third = math.log(1 / 3)
    mb = {
        "input_ids": torch.tensor([0, 1, 2, 0]),
        "cu_seqlens": torch.tensor([0, 4]),
        "action_mask": torch.tensor([False, True, True, False]),
        "advantages": torch.tensor([0.0, 1.0, 1.0, 0.0]),
        "behav_logp": torch.tensor([0.0, third - math.log(0.01), third, 0.0]),  # position 1: constrained, p(A) 0.01
    }
    loss = _Loss(1.0, None, Correction("tis", 2.0))
    assert loss(logits, mb).item() == pytest.approx(-(0.01 * third + third) / 2)  # before: weight 0.01
    mb["limited_mask"] = torch.tensor([False, True, False, False])
    assert loss(logits, mb).item() == pytest.approx(-third)  # both tokens weigh 1
