"""Trainer-side replay of truncated sampling (tandemrl.algorithms.truncation) on hand-computed values,
and its kept set against vLLM's own top-k/top-p function on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.algorithms.truncation import Truncation, kept_mask, policy_logprobs, truncated_logprobs
from tandemrl.models.functional import gather_logprobs


def _lp(logits: list[float], token: int, **kw: float) -> tuple[float, bool]:
    logp, outside = truncated_logprobs(torch.tensor([logits]), torch.tensor([token]), **kw)
    return float(logp[0]), bool(outside[0])


def _lse(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs))


def test_no_filter_is_the_full_vocabulary_at_the_temperature() -> None:
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.arange(6)
    logp, outside = truncated_logprobs(logits, tokens, temperature=0.7)
    torch.testing.assert_close(logp, gather_logprobs(logits, tokens, 0.7), rtol=0, atol=1e-6)
    assert not outside.any()


def test_top_k_keeps_the_k_largest_and_every_tie_with_the_kth() -> None:
    assert _lp([3, 1, 2, 0], 2, top_k=2) == pytest.approx((2 - _lse(3, 2), False), abs=1e-6)
    # Two logits tie with the 2nd largest: both stay, so three tokens are kept.
    assert _lp([2, 1, 1, 0], 1, top_k=2) == pytest.approx((1 - _lse(2, 1, 1), False), abs=1e-6)
    # top_k >= vocab keeps everything.
    assert _lp([2, 1, 1, 0], 3, top_k=9) == pytest.approx((0 - _lse(2, 1, 1, 0), False), abs=1e-6)


def test_top_p_keeps_the_smallest_top_set_reaching_p() -> None:
    # Four equal logits: probabilities exactly 1/4. p=0.5: two tokens reach exactly 0.5 (mass == p is enough);
    # the tie is broken in token-id order, the lower ids dropped first.
    assert _lp([0, 0, 0, 0], 3, top_p=0.5) == pytest.approx((math.log(1 / 2), False), abs=1e-6)
    assert _lp([0, 0, 0, 0], 2, top_p=0.5) == pytest.approx((math.log(1 / 2), False), abs=1e-6)
    assert _lp([0, 0, 0, 0], 1, top_p=0.5)[1] is True
    # p=0.6: two tokens (0.5) fall short, three are kept.
    assert _lp([0, 0, 0, 0], 1, top_p=0.6) == pytest.approx((math.log(1 / 3), False), abs=1e-6)
    assert _lp([0, 0, 0, 0], 0, top_p=0.6)[1] is True
    # The most probable token always stays, however small p is.
    assert _lp([1, 0, 0], 0, top_p=0.01) == pytest.approx((0.0, False), abs=1e-6)


def test_top_p_applies_to_what_top_k_left_renormalised() -> None:
    logits = [3, 2, 1, 0, -1]
    # top_k=3 then top_p=0.9: over {3, 2, 1} the smallest (mass 0.090) is dropped -> {3, 2}.
    assert _lp(logits, 1, top_k=3, top_p=0.9) == pytest.approx((2 - _lse(3, 2), False), abs=1e-6)
    assert _lp(logits, 2, top_k=3, top_p=0.9)[1] is True
    # top_p=0.9 alone keeps {3, 2, 1} (the tail 0.032 + 0.012 is under 0.1).
    assert _lp(logits, 2, top_p=0.9) == pytest.approx((1 - _lse(3, 2, 1), False), abs=1e-6)


def test_min_p_drops_tokens_under_min_p_times_the_top_probability() -> None:
    # p(-1) / p(2) = e^-3 = 0.0498 < 0.1 <= p(0) / p(2) = e^-2 = 0.135.
    assert _lp([2, 1, 0, -1], 2, min_p=0.1) == pytest.approx((0 - _lse(2, 1, 0), False), abs=1e-6)
    assert _lp([2, 1, 0, -1], 3, min_p=0.1)[1] is True
    # min_p comes first: top_k=3 then has only three tokens left anyway.
    assert _lp([2, 1, 0, -1], 1, min_p=0.1, top_k=3) == pytest.approx((1 - _lse(2, 1, 0), False), abs=1e-6)


def test_temperature_scales_before_truncating() -> None:
    # T=0.5: logits [4, 2, 0, -2]; top_k=2 keeps {4, 2}.
    assert _lp([2, 1, 0, -1], 1, temperature=0.5, top_k=2) == pytest.approx((2 - _lse(4, 2), False), abs=1e-6)
    # The temperature changes the top-p set: at T=1 p=0.7 keeps {2, 1} (the top token has 0.644 < 0.7);
    # at T=0.5 the top token alone has 0.867 >= 0.7.
    assert _lp([2, 1, 0, -1], 1, top_p=0.7) == pytest.approx((1 - _lse(2, 1), False), abs=1e-6)
    assert _lp([2, 1, 0, -1], 1, temperature=0.5, top_p=0.7)[1] is True


def test_a_token_outside_the_kept_set_is_scored_over_the_set_plus_itself() -> None:
    logp, outside = _lp([3, 1, 2, 0], 1, top_k=2)
    assert outside is True
    assert logp == pytest.approx(1 - _lse(3, 2, 1), abs=1e-6)


def test_gradient_flows_through_kept_logits_only() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]], requires_grad=True)
    logp, _ = truncated_logprobs(logits, torch.tensor([0]), top_k=2)
    logp.sum().backward()
    assert logits.grad is not None
    p0 = math.exp(3 - _lse(3, 2))
    torch.testing.assert_close(logits.grad[0], torch.tensor([1 - p0, 0.0, -(1 - p0), 0.0]), rtol=0, atol=1e-6)


def test_policy_logprobs_dispatches_on_the_replay() -> None:
    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3, 4])
    full, entropy, outside = policy_logprobs(logits, labels, 1.0, None, with_entropy=True)
    assert outside is None and entropy is not None
    torch.testing.assert_close(full, gather_logprobs(logits, labels))
    replayed, entropy_r, outside_r = policy_logprobs(logits, labels, 1.0, Truncation(top_k=3), with_entropy=True)
    assert outside_r is not None and entropy_r is not None
    torch.testing.assert_close(entropy_r, entropy)  # the full distribution's entropy either way
    inside = ~outside_r
    assert inside.any() and bool((replayed[inside] > full[inside]).all())  # renormalised over fewer tokens


@pytest.mark.parametrize(("top_k", "top_p"), [(20, None), (None, 0.8), (20, 0.8), (5, 0.3), (1, None), (None, 0.999)])
def test_kept_set_equals_vllms_top_k_top_p(top_k: int | None, top_p: float | None) -> None:
    """The same kept set as vLLM's PyTorch sampler (the CPU build's path) on random temperature-scaled logits."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(7)
    scaled = torch.randn(64, 500, generator=g) * 3
    k = None if top_k is None else torch.full((64,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((64,), top_p, dtype=torch.float32)
    theirs = apply_top_k_top_p_pytorch(scaled.clone(), k, p, allow_cpu_sync=True) != float("-inf")
    ours = kept_mask(scaled, top_k or -1, top_p or 1.0)
    assert torch.equal(ours, theirs)
    assert 0 < int(ours.sum(-1).min()) and int(ours.sum(-1).max()) < 500  # something was truncated, not all


def test_kept_mask_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandemrl.algorithms.truncation as truncation

    scaled = torch.randn(37, 50, generator=torch.Generator().manual_seed(3))
    whole = kept_mask(scaled, 10, 0.7, 0.01)
    monkeypatch.setattr(truncation, "_CHUNK_ELEMENTS", 50 * 4)  # 4 rows at a time
    assert torch.equal(kept_mask(scaled, 10, 0.7, 0.01), whole)


def _by_hand(row: list[float], token: int, top_k: int, top_p: float) -> tuple[float, float, bool]:
    """(truncated logp, full-vocabulary logp, outside) of ``token``, written out: the k largest logits
    (random ones: no ties), then the smallest top set of those, renormalised, whose mass reaches p;
    a token outside is scored over the kept set plus itself."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[:top_k]
    total = sum(math.exp(row[i]) for i in order)
    kept: list[int] = []
    mass = 0.0
    for i in order:
        kept.append(i)
        mass += math.exp(row[i]) / total
        if mass >= top_p:
            break
    outside = token not in kept
    scored = kept + [token] if outside else kept
    return row[token] - _lse(*(row[i] for i in scored)), row[token] - _lse(*row), outside


@pytest.mark.parametrize("replayed", [True, False])
def test_ppo_loss_ratios_use_the_replay_and_count_outside_tokens(replayed: bool) -> None:
    """PPOActor's training loss on one packed sequence whose old logprobs are the sampler's truncated ones,
    computed by hand: the ratio is 1 on every action token with the replay, exp(full - truncated) without;
    outside tokens are counted."""
    from tandemrl.algorithms.ppo import PPOActor
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.configs.ppo import PPOActorConfig
    from tandemrl.utils import stats_tracker

    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    ids, cu = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([0, 8], dtype=torch.int32)
    action = torch.tensor([False, False, True, True, True, True, True, False])
    old, ratios, outside = torch.zeros(8), [], []
    for t in range(2, 7):  # action position t predicts ids[t + 1]
        truncated, full, out = _by_hand(logits[t].tolist(), int(ids[t + 1]), top_k=4, top_p=0.9)
        old[t] = truncated
        ratios.append(math.exp(full - truncated))
        outside.append(out)
    assert 0 < sum(outside) < len(outside)  # this draw has tokens on both sides
    mb = {"input_ids": ids, "cu_seqlens": cu, "action_mask": action, "advantages": torch.ones(8)}
    mb |= {"old_logp": old, "behav_logp": old}  # the server's (truncated) logprobs, as a batch carries them
    cfg = PPOActorConfig(
        engine=TrainEngineConfig(path="unused"),
        truncation_replay=replayed,
        top_k=4,
        top_p=0.9,
        offpolicy_correction="none",
    )
    stats_tracker.export(reset=True)
    PPOActor(cfg, engine=None)._loss(logits, mb)  # type: ignore[arg-type]
    stats = stats_tracker.export(reset=True)
    ratio = stats["importance_weight/avg"]
    if replayed:
        assert ratio == pytest.approx(1.0, abs=1e-6)
        assert stats["truncation_outside_frac/avg"] == pytest.approx(sum(outside) / len(outside))
    else:
        assert ratio == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
        assert ratio < 1 and "truncation_outside_frac/avg" not in stats
