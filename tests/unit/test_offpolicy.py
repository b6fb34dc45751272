"""Train/rollout mismatch corrections and metrics (tandemrl.algorithms.offpolicy) on hand-computed values.

Packed 1-D layout with ``cu_seqlens`` like the loss code: sequence A has token ratios
rho = [4, 1, 0.5] (product R = 2, geometric mean G = 2^(1/3) ~ 1.26), sequence B has
[1.5, 1] (R = 1.5, G = sqrt(1.5) ~ 1.22) and a masked last token carrying junk.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.algorithms.constrained import behaviour_for_weights, forced_tokens, limited_actions, mostly_forced
from tandemrl.algorithms.offpolicy import (
    Correction,
    correction_weights,
    mismatch_token_stats,
    resolve_correction,
    version_stats,
)
from tandemrl.algorithms.policy_loss import ppo_policy_loss
from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import NormConfig, PPOActorConfig
from tandemrl.utils import stats_tracker

CU = torch.tensor([0, 3, 6], dtype=torch.int32)
MASK = torch.tensor([1, 1, 1, 1, 1, 0]).bool()
RHO = [4.0, 1.0, 0.5, 1.5, 1.0]
G_A, G_B = 2.0 ** (1 / 3), math.sqrt(1.5)


def _logps(invert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(prox_logp, behav_logp) with exp(prox - behav) = RHO (or 1 / RHO); junk on the masked token."""
    lr = torch.tensor([math.log(r) for r in RHO] + [0.0]) * (-1.0 if invert else 1.0)
    prox = lr - 2.0
    prox[5] = float("-inf")
    return prox, torch.full((6,), -2.0)


def _weights(kind: str, cap: float = 2.0, invert: bool = False, **kw: object) -> dict[str, list]:
    prox, behav = _logps(invert)
    out = correction_weights(prox, behav, MASK, Correction(kind, cap, **kw), CU)
    return {k: v.tolist() for k, v in out.items()}


@pytest.mark.parametrize(
    ("kind", "cap", "kw", "weight", "truncated"),
    [
        ("none", 2.0, {}, [1, 1, 1, 1, 1, 0], []),
        ("tis", 2.0, {}, [2, 1, 0.5, 1.5, 1, 0], [0]),
        ("cispo", 2.0, {}, [2, 1, 0.5, 1.5, 1, 0], [0]),
        ("mis", 2.0, {}, [0, 1, 0.5, 1.5, 1, 0], []),
        ("icepop", 2.0, {}, [0, 1, 0.5, 1.5, 1, 0], []),  # [1/2, 2]: 0.5 is inside
        ("icepop", 2.0, {"cap_low": 1.5}, [0, 1, 0, 1.5, 1, 0], []),  # [2/3, 2]
        ("seq_tis", 1.8, {}, [1.8, 1.8, 1.8, 1.5, 1.5, 0], [0, 1, 2]),  # R_A = 2 cut to 1.8
        ("seq_mis", 1.8, {}, [0, 0, 0, 1.5, 1.5, 0], []),
        ("seq_tis", 1.25, {"seq_ratio": "geometric"}, [1.25] * 3 + [G_B] * 2 + [0], [0, 1, 2]),
        ("seq_mis", 1.25, {"seq_ratio": "geometric"}, [0, 0, 0, G_B, G_B, 0], []),
        ("geo_mask", 1.25, {}, [0, 0, 0, G_B, G_B, 0], []),  # G_A ~ 1.26 > 1.25
        ("geo_mask", 1.3, {}, [G_A] * 3 + [G_B] * 2 + [0], []),
    ],
)
def test_correction_weights(kind: str, cap: float, kw: dict, weight: list, truncated: list) -> None:
    got = _weights(kind, cap, **kw)
    assert got["weight"] == pytest.approx(weight)
    assert got["kept"] == [w > 0 for w in weight]
    assert [i for i, t in enumerate(got["truncated"]) if t] == truncated


def test_two_sided_masks_drop_low_ratios() -> None:
    # Inverted ratios [1/4, 1, 2, 2/3, 1]: icepop [1/2, 2] drops only the 1/4 token (2 is inside).
    assert _weights("icepop", 2.0, invert=True)["weight"] == pytest.approx([0, 1, 2, 2 / 3, 1, 0])
    # G_A = 0.794 < 1/1.25 = 0.8 drops A; G_B = 0.816 keeps B, weighted by G_B.
    assert _weights("geo_mask", 1.25, invert=True)["weight"] == pytest.approx([0, 0, 0, 1 / G_B, 1 / G_B, 0])
    # Without the two-sided masks a low ratio is kept as is.
    assert _weights("mis", 2.0, invert=True)["weight"] == pytest.approx([0.25, 1, 2, 2 / 3, 1, 0])


def test_huge_sequence_ratios_stay_finite() -> None:
    prox = torch.full((6,), 50.0)  # product of token ratios e^250: overflows float32
    behav = torch.zeros(6)
    for kind in ("seq_tis", "seq_mis", "tis", "mis"):
        w = correction_weights(prox, behav, MASK, Correction(kind, 2.0), CU)["weight"]
        assert torch.isfinite(w).all(), kind
        assert w.tolist() == ([2.0] * 5 + [0.0] if kind.endswith("tis") else [0.0] * 6), kind


def test_padded_layout_matches_packed() -> None:
    prox, behav = _logps()
    prox[5] = 0.0
    pad = lambda x: torch.stack([x[:3], x[3:]])  # noqa: E731
    for kind in ("seq_tis", "geo_mask"):
        c = Correction(kind, 1.8)
        packed = correction_weights(prox, behav, MASK, c, CU)["weight"]
        padded = correction_weights(pad(prox), pad(behav), pad(MASK), c)["weight"]
        assert padded.flatten().tolist() == pytest.approx(packed.tolist()), kind


def test_resolve_auto_and_legacy_fields() -> None:
    assert resolve_correction("auto") == Correction("tis", 2.0)
    assert resolve_correction("auto", 3.0) == Correction("tis", 3.0)
    # The decoupled-PPO fields are the 'mis' case (cap) or untruncated IS (no cap).
    assert resolve_correction("auto", use_decoupled_loss=True, behav_imp_weight_cap=5.0) == Correction("mis", 5.0)
    assert resolve_correction("auto", use_decoupled_loss=True) == Correction("tis", math.inf)
    assert resolve_correction("icepop", 3.0, 1.5) == Correction("icepop", 3.0, 1.5)
    assert not resolve_correction("none").active
    bad = [
        (("sometimes",), "PPOActorConfig.offpolicy_correction: 'sometimes' is not one of auto, none, tis"),
        (("tis", 0.5), "PPOActorConfig.offpolicy_cap must be >= 1, got 0.5"),
        (("icepop", 2.0, 0.9), "PPOActorConfig.offpolicy_cap_low must be >= 1"),
        (("seq_tis", 2.0, None, "mean"), "PPOActorConfig.offpolicy_seq_ratio: 'mean' is not one of"),
        (("none", 2.0, None, "product", True), "'none' contradicts use_decoupled_loss=true"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")) as err:
            resolve_correction(*args)
        assert "\n" not in str(err.value)


def test_config_loader_names_bad_values() -> None:
    from tandemrl.configs import GRPOConfig
    from tandemrl.configs.loader import ConfigError
    from tandemrl.trainers.entry import load_config

    cfg, _ = load_config(["actor.offpolicy_correction=icepop", "actor.offpolicy_cap_low=4"], GRPOConfig)
    assert (cfg.actor.offpolicy_correction, cfg.actor.offpolicy_cap_low) == ("icepop", 4.0)
    with pytest.raises(ConfigError, match="'actor.offpolicy_correction' .*expects one of auto, none, tis"):
        load_config(["actor.offpolicy_correction=tiss"], GRPOConfig)
    with pytest.raises(ConfigError, match="'actor.offpolicy_cap' .*must be >= 1.0"):
        load_config(["actor.offpolicy_cap=0.5"], GRPOConfig)
    assert PPOActorConfig().offpolicy_correction == "auto"


# ------------------------------------------------------------------------------------------- losses and gradients
ADV = torch.tensor([1.0, -1.0, 2.0, 1.0, -2.0, 5.0])


def test_tis_weights_loss_without_gradient_through_weight() -> None:
    prox, behav = _logps()
    prox[5] = 0.0
    # The free proximal: old = this forward's detached logp, so r = 1 and w = min(exp(logp - behav), C).
    logp = prox.clone().requires_grad_(True)
    loss, st = ppo_policy_loss(
        logp, logp.detach(), ADV, MASK, 0.2, behav_logp=behav, correction=Correction("tis", 2.0), cu_seqlens=CU
    )
    w = [2.0, 1.0, 0.5, 1.5, 1.0]
    assert loss.item() == pytest.approx(sum(-a * x for a, x in zip(ADV.tolist(), w, strict=False)) / 5)
    loss.backward()
    # d/dlogp = -A * w / n: w is a constant (a gradient through it would add -A * w * [rho < C] / n).
    expected = [-a * x / 5 for a, x in zip(ADV.tolist(), w, strict=False)] + [0.0]
    assert logp.grad.tolist() == pytest.approx(expected)
    assert st["behav_truncated"].tolist() == [True] + [False] * 5
    # A differentiable proximal policy still gives a constant weight.
    for kind in ("tis", "mis", "seq_tis", "geo_mask", "icepop", "cispo"):
        grad_prox = prox.clone().requires_grad_(True)
        assert not correction_weights(grad_prox, behav, MASK, Correction(kind), CU)["weight"].requires_grad, kind


def test_mask_corrections_drop_tokens_but_keep_denominator() -> None:
    prox, behav = _logps()
    logp = prox.clone().detach()
    logp[5] = 0.0
    logp.requires_grad_(True)
    loss, st = ppo_policy_loss(
        logp, prox, ADV, MASK, 0.2, behav_logp=behav, correction=Correction("icepop", 2.0, 1.5), cu_seqlens=CU
    )
    # Kept: tokens 1 (w 1) and 3 (w 1.5), 4 (w 1); r = 1 everywhere; denominator 5 tokens.
    assert loss.item() == pytest.approx((1.0 - 1.5 + 2.0) / 5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1.0 / 5, 0.0, -1.5 / 5, 2.0 / 5, 0.0])
    assert st["behav_kept"].tolist() == [False, True, False, True, True, False]


def test_legacy_cap_equals_mis() -> None:
    prox, behav = _logps()
    logp = torch.zeros(6)
    legacy, st1 = ppo_policy_loss(logp, prox.clamp(min=-9), ADV, MASK, 0.2, behav_logp=behav, behav_imp_weight_cap=2.0)
    new, st2 = ppo_policy_loss(
        logp, prox.clamp(min=-9), ADV, MASK, 0.2, behav_logp=behav, correction=resolve_correction("mis", 2.0)
    )
    assert legacy.item() == new.item() and torch.equal(st1["behav_imp_weight"], st2["behav_imp_weight"])
    with pytest.raises(ValueError, match="not both"):
        ppo_policy_loss(logp, prox, ADV, MASK, 0.2, behav_logp=behav, behav_imp_weight_cap=2.0, correction=Correction())


def test_cispo_gradient_is_clipped_weight_times_advantage() -> None:
    # r = exp(logp - old) = [1.5, 0.5, 1.1]: clip(r, 0.8, 1.2) = [1.2, 0.8, 1.1] (clipped tokens keep a gradient).
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1)], requires_grad=True)
    old, adv, mask = torch.zeros(3), torch.tensor([1.0, -1.0, 2.0]), torch.ones(3, dtype=torch.bool)
    behav = torch.log(torch.tensor([0.25, 1.0, 1.0]))  # rho = [4, 1, 1] -> tis w = [2, 1, 1]
    loss, st = ppo_policy_loss(logp, old, adv, mask, 0.2, behav_logp=behav, correction=Correction("cispo", 2.0))
    clipped, w = [1.2, 0.8, 1.1], [2.0, 1.0, 1.0]
    lp = logp.detach().tolist()
    assert loss.item() == pytest.approx(
        sum(-c * x * a * p for c, x, a, p in zip(clipped, w, adv.tolist(), lp, strict=True)) / 3
    )
    loss.backward()
    assert logp.grad.tolist() == pytest.approx(
        [-c * x * a / 3 for c, x, a in zip(clipped, w, adv.tolist(), strict=True)]
    )
    assert st["clip_mask"].tolist() == [True, True, False] and st["ratio"].tolist() == pytest.approx([1.5, 0.5, 1.1])
    with pytest.raises(ValueError, match="c_clip"):
        ppo_policy_loss(logp, old, adv, mask, 0.2, c_clip=3.0, behav_logp=behav, correction=Correction("cispo"))


# ------------------------------------------------------------------------------------------------------ metrics
def test_mismatch_token_stats() -> None:
    trainer, behav = torch.tensor([-1.0, -2.0, 7.0]), torch.tensor([-1.5, -1.0, 0.0])
    st = mismatch_token_stats(trainer, behav, torch.tensor([True, True, False]))
    assert st["abs_dlogp"].tolist() == pytest.approx([0.5, 1.0, 0.0])
    # KL(behaviour || trainer), k3 with d = behav - trainer = [-0.5, 1]: e^-d - 1 + d.
    assert st["kl_k3"].tolist() == pytest.approx([math.exp(0.5) - 1.5, math.exp(-1.0), 0.0])


def test_version_stats_lag_and_interrupted_generations() -> None:
    versions = torch.tensor([[-1, 3, 3, 3], [-1, 2, 3, -1], [-1, -1, -1, -1], [-1, 4, 4, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 0]]).bool()
    st = version_stats(versions, mask, current_version=4)
    assert st["has_tokens"].tolist() == [True, True, False, True]
    assert st["lag"].tolist() == [1.0, 2.0, 0.0, 0.0]  # the oldest token of each row
    assert st["multi_version"].tolist() == [[False] * 4, [False, True, True, False], [False] * 4, [False] * 4]
    with pytest.raises(ValueError, match="'versions' has shape"):
        version_stats(versions[:, :3], mask, 4)


# --------------------------------------------------------------------------- stale samples and overflow
# One sequence of three tokens, A = 1; the server sampled it at older weights than the trainer's.
BEHAV = [-3.0, -0.7, -0.1]
TRAINER = [-0.5, -0.7, -2.0]


def _stale_gradient(kind: str, prox_recomputed: bool) -> list[float]:
    """d loss / d trainer logp for ``kind``; ``prox_recomputed``: the proximal logprobs were recomputed
    (they equal the trainer's: a one-step update), else the update's own forward stands in for them."""
    from tandemrl.algorithms.offpolicy import old_policy_logp

    logp = torch.tensor(TRAINER, requires_grad=True)
    behav = torch.tensor(BEHAV)
    correction = Correction(kind)
    prox = logp.detach().clone() if prox_recomputed else None
    old = old_policy_logp(correction, behav, prox)
    if prox is None and correction.active:
        old = logp.detach()  # PPOActor._loss: forward_is_proximal
    loss, _ = ppo_policy_loss(
        logp, old, torch.ones(3), torch.ones(3).bool(), 0.2, behav_logp=behav, correction=correction
    )
    loss.backward()
    return logp.grad.tolist()


def test_stale_samples_gradient_per_correction() -> None:
    """``none`` clips against the behaviour policy whether or not the proximal logprobs were recomputed
    (r = exp(trainer - behav) = [12.18, 1, 0.1496]: token 0 clipped, token 2 weighs r / 3); ``tis``
    has r = 1 and weights min(exp(trainer - behav), 2) = [2, 1, 0.1496]. Hand values, token-mean over 3."""
    r2 = math.exp(-2.0 - -0.1)
    for recomputed in (True, False):
        assert _stale_gradient("none", recomputed) == pytest.approx([0.0, -1 / 3, -r2 / 3], abs=1e-6)
        assert _stale_gradient("tis", recomputed) == pytest.approx([-2 / 3, -1 / 3, -r2 / 3], abs=1e-6)
    assert r2 / 3 == pytest.approx(0.0499, abs=1e-4)


def test_ratio_overflow_is_clamped_and_nonfinite_tokens_dropped() -> None:
    """A log-ratio of 100 (exp overflows fp32 past 88.7) on a zero-advantage token and a -inf logprob
    on another used to make the loss and every gradient NaN; now the first is clamped to +-20 and the
    second dropped (weight 0, still in the token-mean's denominator of 4)."""
    logp = torch.tensor([100.0, float("-inf"), -1.0, -2.0], requires_grad=True)
    old = torch.tensor([0.0, -1.0, -1.0, -2.0])
    adv = torch.tensor([0.0, 1.0, 1.0, -1.0])
    mask = torch.ones(4).bool()
    loss, st = ppo_policy_loss(logp, old, adv, mask, 0.2, correction=Correction("none"), behav_logp=old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    # Tokens 2 and 3 have r = 1: loss (-1 + 1) / 4 = 0, gradients -A / 4.
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.25, 0.25])
    assert st["ratio_clamped"].tolist() == [True, False, False, False]
    assert st["nonfinite"].tolist() == [False, True, False, False]
    assert st["ratio"][0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    # GSPO: the sequence's mean log-ratio over its finite tokens, clamped too.
    cu = torch.tensor([0, 4], dtype=torch.int32)
    loss, st = ppo_policy_loss(
        logp.detach(), old, adv, mask, 0.2, ratio_level="sequence", cu_seqlens=cu, correction=Correction("none")
    )
    assert torch.isfinite(loss) and st["ratio_clamped"][[0, 2, 3]].all() and st["nonfinite"][1]


def test_nonfinite_behaviour_ratios_drop_their_token() -> None:
    """Both logprobs -inf (NaN ratio) or the server's -inf: dropped by every active kind, left out of the
    sequence ratio; before, tis/seq_tis weights were NaN."""
    prox = torch.tensor([float("-inf"), -1.0, math.log(2.0) - 1.0])
    behav = torch.tensor([float("-inf"), float("-inf"), -1.0])
    mask = torch.ones(3).bool()
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for kind in ("tis", "mis", "seq_tis", "seq_mis", "geo_mask", "icepop", "cispo"):
        w = correction_weights(prox, behav, mask, Correction(kind, cap=4.0), cu)
        assert torch.isfinite(w["weight"]).all(), (kind, w["weight"])
        assert w["weight"][:2].tolist() == [0.0, 0.0] and w["kept"][:2].tolist() == [False, False], kind
        assert w["weight"][2].item() == pytest.approx(2.0), kind  # the sequence ratio is the third token's alone
    stats = mismatch_token_stats(prox, behav, mask)
    assert torch.isfinite(stats["abs_dlogp"]).all() and torch.isfinite(stats["kl_k3"]).all()


# ------------------------------------------------------------------------------------- constrained decoding
def test_forced_tokens_need_a_constraint_and_a_zero_logprob() -> None:
    behav = torch.tensor([[0.0, -0.5, 0.0, 0.0, 0.0, -1e-7]])
    constrained = torch.tensor([[1, 1, 1, 0, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]]).bool()
    # 0: forced; 1: a choice among allowed tokens; 3: 0.0 without a constraint (greedy); 4: off the mask;
    # 5: close to but not exactly 0 (the constraint left more than one token).
    assert forced_tokens(behav, constrained, mask).tolist() == [[True, False, True, False, False, False]]
    with pytest.raises(ValueError, match="'constrained' has shape"):
        forced_tokens(behav, constrained[:, :4], mask)
    assert mostly_forced(3, 5) and not mostly_forced(3, 6) and not mostly_forced(0, 0)


def _constrained_batch(constrained_row1: int) -> dict[str, torch.Tensor]:
    """One group of two rows, prompts of 2 tokens. Row 0: a constrained call whose tokens 2, 4, 5
    were forced (logprob 0.0) and token 3 a choice (-1.0). Row 1: 0.0 on token 2 too, constrained
    or not (``constrained_row1``); token 3 a choice (-0.5)."""
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, 2], [5, 6, 7, 8, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]).bool(),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]),
        "logprobs": torch.tensor([[0.0, 0.0, 0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, -0.5, 0.0, 0.0]]),
        "constrained": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, constrained_row1, constrained_row1, 0, 0]]),
        "rewards": torch.tensor([1.0, 0.0]),
    }


def _constrained_actor() -> PPOActor:
    cfg = PPOActorConfig(engine=TrainEngineConfig(path="unused"), group_size=2)
    cfg.adv_norm = NormConfig(mean_level="none", std_level="none")
    return PPOActor(cfg, engine=None)  # compute_advantages needs no engine outside torch.distributed


def test_forced_tokens_leave_the_update(caplog: pytest.LogCaptureFixture) -> None:
    """Forced tokens leave action_mask (so the ratio, the correction and the loss), are counted in
    ``ppo_actor/offpolicy/forced``; more than half of the batch forced logs one warning; without a
    ``constrained`` field nothing is dropped."""
    stats_tracker.export()  # start from an empty tracker
    b = _constrained_actor().compute_advantages(_constrained_batch(constrained_row1=0))
    # Next-token aligned: position t emits token t + 1. Row 0 keeps only token 3 (position 2);
    # row 1's 0.0 at token 2 was not under a constraint: kept.
    assert b["forced_mask"].tolist() == [[False, True, False, True, True, False], [False] * 6]
    assert b["action_mask"].tolist() == [[False, False, True, False, False, False], [False, True, True] + [False] * 3]
    assert b["advantages"].tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 6]
    assert b["token_rewards"][0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # the reward on the last free token
    assert stats_tracker.export()["ppo_actor/offpolicy/forced"] == pytest.approx(3 / 6)
    assert not [r for r in caplog.records if "forced" in r.getMessage()]  # 3 of 6: not more than half
    # The symptom: the unconstrained trainer gives the forced tokens e^-6; their ratios
    # e^-6 / 1 no longer drag the batch's mean correction weight (free tokens' ratios: 1.5, 1, 0.5).
    behav = b["behav_logp"]
    prox = behav + torch.tensor([[0.0, -6.0, math.log(1.5), -6.0, -6.0, 0.0], [0.0, 0.0, math.log(0.5), 0, 0, 0]])
    w = correction_weights(prox, behav, b["action_mask"], Correction("tis", 2.0))["weight"]
    assert w[b["action_mask"]].tolist() == pytest.approx([1.5, 1.0, 0.5])
    # Row 1 constrained as well: its token 2 is forced, 4 of 6 generated tokens: one warning.
    with caplog.at_level("WARNING", logger="tandemrl.algorithms.ppo"):
        b = _constrained_actor().compute_advantages(_constrained_batch(constrained_row1=1))
    assert b["action_mask"].tolist() == [[False, False, True, False, False, False], [False, False, True] + [False] * 3]
    assert stats_tracker.export()["ppo_actor/offpolicy/forced"] == pytest.approx(4 / 6)
    warned = [r.getMessage() for r in caplog.records if "forced" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("4 of 6 generated tokens"), warned
    # A batch that marks no constrained call keeps every 0.0 token (greedy, top-k = 1).
    batch = _constrained_batch(constrained_row1=1)
    del batch["constrained"]
    b = _constrained_actor().compute_advantages(batch)
    assert "forced_mask" not in b
    assert b["action_mask"].tolist() == [[False, True, True, True, True, False], [False, True, True] + [False] * 3]


def test_tokens_a_constraint_limited_weigh_one_in_the_correction() -> None:
    """A token a grammar limited but did not force: the server's logprob is of the constrained distribution,
    log p(a) - log p(A), the trainer's of p itself, log p(a); their ratio is the allowed mass p(A), which scaled
    the agent example's updates ~100x (behav_imp_weight 0.01). The trainer compares such tokens against its own
    proximal logprob (weight 1); other tokens keep their ratios, and a batch without constrained calls is as
    before (docs/offpolicy.md, "Constrained tokens")."""
    stats_tracker.export()
    b = _constrained_actor().compute_advantages(_constrained_batch(constrained_row1=0))
    action = b["action_mask"]
    # Row 0's token 3 (position 2) was a choice under the constraint; row 1 had no constraint.
    assert b["limited_mask"].tolist() == [[False, False, True, False, False, False], [False] * 6]
    assert limited_actions(b, action).tolist() == b["limited_mask"].tolist()
    assert stats_tracker.export()["ppo_actor/offpolicy/limited"] == pytest.approx(1 / 3)  # 1 of 3 actions
    behav = b["behav_logp"]
    allowed_mass = 0.01  # p(A) at the limited token; row 1's free tokens moved by 1.5 and 0.5
    prox = behav + torch.tensor(
        [[0.0, 0.0, math.log(allowed_mass), 0, 0, 0], [0.0, math.log(1.5), math.log(0.5), 0, 0, 0]]
    )
    tis = Correction("tis", 2.0)
    before = correction_weights(prox, behav, action, tis)["weight"][action]
    assert before.tolist() == pytest.approx([allowed_mass, 1.5, 0.5])
    fixed = behaviour_for_weights(behav, prox, b["limited_mask"])
    assert correction_weights(prox, fixed, action, tis)["weight"][action].tolist() == pytest.approx([1.0, 1.5, 0.5])
    assert fixed[~b["limited_mask"]].tolist() == behav[~b["limited_mask"]].tolist()  # only limited tokens change
    assert behaviour_for_weights(behav, prox, None) is behav
    unconstrained = _constrained_batch(constrained_row1=0)
    del unconstrained["constrained"]
    assert "limited_mask" not in _constrained_actor().compute_advantages(unconstrained)
