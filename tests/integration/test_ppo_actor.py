"""PPOActor / PPOCritic / ReinforceActor: advantages on hand-computed batches, and 2-rank FSDP updates
that must equal a plain single-process PyTorch reference (independent loss code, same AdamW)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from utils import run_torchrun

from tandemrl.algorithms.layout import shift_left
from tandemrl.algorithms.ppo import PPOActor, PPOCritic, split_minibatches
from tandemrl.algorithms.recompute import needs_logp_recompute, server_logp
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import NormConfig, PPOActorConfig, PPOCriticConfig

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ppo_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}


# --------------------------------------------------------------------------- compute_advantages (no engine)
def _batch() -> dict[str, torch.Tensor]:
    """Two groups of two rows; prompts of 2 tokens; responses of 3, 1, 2, 2 tokens (token-aligned)."""
    loss_mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.long
    )
    am = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]).bool()
    ids = torch.tensor([[5, 6, 7, 8, 2, 0], [5, 6, 2, 0, 0, 0], [5, 9, 7, 2, 0, 0], [5, 9, 7, 7, 0, 0]])
    logprobs = torch.tensor(
        [
            [0.0, 0.0, -1.0, -2.0, -3.0, 0.0],
            [0.0, 0.0, -4.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, -0.5, -1.5, 0.0, 0.0],
            [0.0, 0.0, -2.5, -0.5, 0.0, 0.0],
        ]
    )
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    }


def _actor(**fields: object) -> PPOActor:
    cfg = PPOActorConfig(engine=TrainEngineConfig(path="unused"), group_size=2)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return PPOActor(cfg, engine=None)  # compute_advantages needs no engine outside torch.distributed


def test_fields_are_next_token_aligned() -> None:
    rollout = _batch()
    b = _actor(adv_norm=NormConfig(mean_level="none", std_level="none")).compute_advantages(rollout)
    assert sorted(rollout) == sorted(_batch()), "compute_advantages returns a new batch; its input is unchanged"
    # Position t acts by emitting token t+1: the first generated token (t=2) is predicted at t=1.
    assert b["action_mask"][0].tolist() == [False, True, True, True, False, False]
    assert b["behav_logp"][0].tolist() == [0.0, -1.0, -2.0, -3.0, 0.0, 0.0]
    # Reward at the last action; no normalization, gamma = lambda = 1: reward-to-go = reward.
    assert b["token_rewards"][0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert b["advantages"][0].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert torch.equal(b["returns"], b["advantages"])


def test_grpo_sequence_vs_token_statistics() -> None:
    b = _actor(adv_norm=NormConfig(mean_level="group", std_level="group", unit="sequence")).compute_advantages(_batch())
    a = 0.5 / (math.sqrt(0.5) + 1e-5)  # group [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    assert b["advantages"][0, 1:4].tolist() == pytest.approx([a] * 3)
    assert b["advantages"][1, 1].item() == pytest.approx(-a)
    assert b["advantages"][2:].abs().max().item() == 0.0  # uniform group: no signal
    # Token statistics weigh rows by length: group-1 tokens are [1, 1, 1, 0] -> mean 0.75.
    b = _actor(adv_norm=NormConfig(mean_level="group", std_level="none", unit="token")).compute_advantages(_batch())
    assert b["advantages"][0, 1:4].tolist() == pytest.approx([0.25] * 3)
    assert b["advantages"][1, 1].item() == pytest.approx(-0.75)


def test_share_of_groups_with_a_non_zero_advantage_is_logged() -> None:
    """The batch stats carry the share of groups whose advantages are not all 0 (curves.png's signal panel)."""
    from tandemrl.utils import stats_tracker

    actor = _actor(adv_norm=NormConfig(mean_level="group", std_level="group", unit="sequence"))
    b = actor.compute_advantages(_batch())  # group [1, 0] carries signal; group [1, 1] does not
    stats_tracker.export_all()  # start from an empty tracker
    with stats_tracker.scope("ppo_actor"):
        actor._record_batch(b)
    out = stats_tracker.export_all()
    assert out["ppo_actor/groups_with_signal"] == pytest.approx(0.5) and out["ppo_actor/n_groups"] == 2.0
    b["advantages"] = torch.zeros_like(b["advantages"])
    with stats_tracker.scope("ppo_actor"):
        actor._record_batch(b)
    assert stats_tracker.export_all()["ppo_actor/groups_with_signal"] == 0.0


def test_kl_reward_and_shaping() -> None:
    b = _batch()
    b["ref_logp"] = torch.full((4, 6), -1.0)
    b["rewards"] = torch.tensor([30.0, 0.0, 1.0, 1.0])
    actor = _actor(
        adv_norm=NormConfig(mean_level="none", std_level="none"),
        kl_ctl=0.1,
        reward_scaling=2.0,
        reward_bias=1.0,
        reward_clip=10.0,
    )
    b = actor.compute_advantages(b)
    assert b["shaped_rewards"].tolist() == [10.0, 2.0, 4.0, 4.0]  # clamp((r + 1) * 2, +-10)
    # k1 on behaviour logp [-1, -2, -3] vs ref -1 -> kl [0, -1, -2] -> reward -0.1 * kl.
    assert b["kl_rewards"][0].tolist() == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.0, 0.0])
    # Reward-to-go: [10 + 0.3, 10 + 0.3, 10 + 0.2].
    assert b["advantages"][0, 1:4].tolist() == pytest.approx([10.3, 10.3, 10.2])
    with pytest.raises(KeyError, match="ref_logp"):
        c = _batch()
        actor.compute_advantages(c)


def test_overlong_and_no_eos() -> None:
    b = _batch()  # response lengths 3, 1, 2, 2; rows 0, 1, 2 end with EOS (id 2), row 3 does not
    actor = _actor(
        adv_norm=NormConfig(mean_level="none", std_level="none"),
        overlong_buffer=2,
        max_new_tokens=3,
        no_eos_penalty=-1.0,
        mask_no_eos=True,
        eos_token_ids=[2],
    )
    b = actor.compute_advantages(b)
    # safe length 1: penalties [-1, 0, -0.5, -0.5]; row 3's reward replaced by -1 first.
    assert b["shaped_rewards"].tolist() == pytest.approx([0.0, 0.0, 0.5, -1.5])
    assert not b["action_mask"][3].any() and b["action_mask"][2].any()


def test_gae_uses_critic_values() -> None:
    b = _batch()
    b["values"] = torch.arange(24, dtype=torch.float32).view(4, 6) / 10
    b = _actor(
        adv_norm=NormConfig(mean_level="none", std_level="none"), discount=0.5, gae_lambda=0.5
    ).compute_advantages(b)
    # Row 1 has one action (t=1, value 0.7, reward 0): A = 0 - 0.7; return = A + V = 0.
    assert b["advantages"][1, 1].item() == pytest.approx(-0.7)
    assert b["returns"][1, 1].item() == pytest.approx(0.0)


def test_bad_inputs_are_named() -> None:
    b = _batch()
    b["rewards"] = torch.ones(4, 6)
    with pytest.raises(ValueError, match="'rewards' must be per-sequence"):
        _actor().compute_advantages(b)
    with pytest.raises(ValueError, match="group_size > 1"):
        PPOActor(PPOActorConfig(adv_norm=NormConfig(mean_level="group")), engine=None)
    with pytest.raises(KeyError, match="compute_advantages"):
        _actor().ppo_update(_batch())
    with pytest.raises(ValueError, match="is_critic"):
        PPOCritic(PPOCriticConfig(engine=TrainEngineConfig()), engine=None)
    with pytest.raises(ValueError, match="ppo_n_minibatches=3"):
        split_minibatches(_batch(), 3, 2)
    parts = split_minibatches(_batch(), 2, 2)
    assert [p["rewards"].tolist() for p in parts] == [[1.0, 0.0], [1.0, 1.0]]


def test_recompute_decision_hand_cases() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    on = torch.tensor([[-1, 5, 5, -1], [-1, -1, 5, 5]])
    assert not needs_logp_recompute("auto", on, mask, 5)  # every generated token from version 5
    assert needs_logp_recompute("always", on, mask, 5)
    stale = on.clone()
    stale[1, 3] = 4  # one token from the previous weights (e.g. interrupted generation)
    assert needs_logp_recompute("auto", stale, mask, 5)
    assert not needs_logp_recompute("never", stale, mask, 5)
    assert needs_logp_recompute("auto", on, mask, 6)  # the trainer moved on since
    ahead = torch.where(mask.bool(), 6, -1)
    assert needs_logp_recompute("auto", ahead, mask, 5)  # not the trainer's weights either
    assert needs_logp_recompute("auto", None, mask, 5)  # unlabelled tokens: cannot prove on-policy
    # Prompt/padding versions do not matter; no generated token at all is vacuously on-policy.
    assert not needs_logp_recompute("auto", torch.where(mask.bool(), 5, 0), mask, 5)
    assert not needs_logp_recompute("auto", on, torch.zeros_like(mask), 5)
    with pytest.raises(ValueError, match="recompute_logprob: 'sometimes'"):
        needs_logp_recompute("sometimes", on, mask, 5)
    with pytest.raises(ValueError, match="'versions' has shape"):
        needs_logp_recompute("auto", on[:, :3], mask, 5)
    # The server's logprobs in the trainer's next-token layout: the behaviour logprobs of compute_advantages.
    b = _batch()
    got = server_logp(b["logprobs"], _actor().compute_advantages(b)["action_mask"])
    assert torch.equal(got, _actor().compute_advantages(_batch())["behav_logp"])
    with pytest.raises(ValueError, match="'never' cannot serve use_decoupled_loss"):
        _actor(recompute_logprob="never", use_decoupled_loss=True)
    with pytest.raises(ValueError, match="recompute_logprob: 'True'"):
        _actor(recompute_logprob="True")
    # A correction over several optimizer steps needs the recomputed proximal policy.
    with pytest.raises(ValueError, match=r"'never' leaves offpolicy_correction 'tis' no proximal policy"):
        _actor(recompute_logprob="never", ppo_n_epochs=2)
    _actor(recompute_logprob="never", ppo_n_epochs=2, offpolicy_correction="none")
    with pytest.raises(ValueError, match="PPOActorConfig.c_clip: .* 'cispo'"):
        _actor(offpolicy_correction="cispo", c_clip=3.0)
    with pytest.raises(ValueError, match="PPOActorConfig.offpolicy_correction: 'tiss' is not one of"):
        _actor(offpolicy_correction="tiss")


def test_registry_rows() -> None:
    from tandemrl.engines.fsdp import FSDPEngine
    from tandemrl.engines.registry import engine_class, make_engine

    # One row per backend (the algorithms run on the FSDP engine it builds in tests/workers/ppo_checks.py).
    assert engine_class("fsdp") is FSDPEngine
    assert type(make_engine("fsdp", TrainEngineConfig(path="unused"))) is FSDPEngine
    with pytest.raises(ValueError, match=r"backend 'nope' \(available: deepspeed, fsdp, megatron\)"):
        engine_class("nope")


# --------------------------------------------------------------------------- 2-rank FSDP vs reference
def _token_logps(model: torch.nn.Module, batch: dict, with_entropy: bool = False) -> list:
    """Per row: (log p of generated tokens, entropy at the positions predicting them), one sequence at a time."""
    out = []
    for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        lp_all = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1]  # position t-1 predicts t
        resp = batch["loss_mask"][i, 1:n].bool()
        lp = lp_all.gather(-1, ids[0, 1:, None]).squeeze(-1)[resp]
        ent = -(lp_all.exp() * lp_all).sum(-1)[resp] if with_entropy else None
        out.append((lp, ent, resp))
    return out


def _reference_update(model_dir: str, batch: dict, tag: str) -> dict[str, torch.Tensor]:
    """One AdamW step of the PPO objective written out by hand on the global batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        initial = [lp for lp, _, _ in _token_logps(model, batch)]
    r = batch["rewards"]
    lens = batch["attention_mask"].sum(1).tolist()
    behav = [batch["logprobs"][i, 1:n][batch["loss_mask"][i, 1:n].bool()] for i, n in enumerate(lens)]
    n_tok = [len(x) for x in initial]
    # Advantages: one value per generated token.
    if tag in ("decoupled", "tis_free"):  # GRPO on sequences: (r - group mean) / (unbiased group std + eps)
        adv = []
        for i in range(len(r)):
            g = r[(i // 2) * 2 : (i // 2) * 2 + 2]
            adv.append(torch.full((n_tok[i],), float((r[i] - g.mean()) / (g.std() + 1e-5))))
    else:  # group token-mean baseline, std over every generated token of the global batch
        tokens = torch.cat([torch.full((n,), float(r[i])) for i, n in enumerate(n_tok)])
        std = tokens.std()
        adv = []
        for i in range(len(r)):
            j = (i // 2) * 2
            base = (r[j] * n_tok[j] + r[j + 1] * n_tok[j + 1]) / (n_tok[j] + n_tok[j + 1])
            adv.append(torch.full((n_tok[i],), float((r[i] - base) / (std + 1e-5))))
    rows = _token_logps(model, batch, with_entropy=(tag in ("clipped", "none_recomputed")))
    per_row = []
    for i, (lp, ent, _) in enumerate(rows):
        a = adv[i]
        if tag == "decoupled":
            prox = initial[i]
            ratio = torch.exp(lp - prox)
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
            w = torch.exp(prox - behav[i])
            per_row.append(loss * torch.where(w <= 1.3, w, torch.zeros_like(w)))
        elif tag == "tis_free":  # ratio 1 (with its gradient) against the update's own forward
            ratio = torch.exp(lp - lp.detach())
            per_row.append(-a * ratio * torch.exp(lp.detach() - behav[i]).clamp(max=1.2))
        else:
            ratio = torch.exp(lp - behav[i])
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.3))
            loss = torch.where(a < 0, torch.minimum(loss, -1.5 * a), loss)
            per_row.append(loss.mean() - 0.01 * ent.mean())
    if tag in ("decoupled", "tis_free"):
        total = torch.cat(per_row).sum() / sum(n_tok)
    else:
        total = torch.stack(per_row).mean()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("ppo")
    run_torchrun(WORKER, 2, ["--model", tiny_model_dir, "--out", out], env=ENV)
    return torch.load(out / "ppo.pt", weights_only=False), out


@pytest.fixture(scope="module")
def initial_params(tiny_model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict())


@pytest.mark.parametrize("tag", ["decoupled", "clipped", "none_recomputed", "tis_free"])
def test_two_rank_update_equals_single_process_reference(
    results: tuple[dict, Path], tiny_model_dir: str, initial_params: dict, tag: str
) -> None:
    res, _ = results
    ref = _reference_update(tiny_model_dir, res["batch"], tag)
    assert _max_diff(res[tag]["params"], initial_params) > 1e-5, "the update must move the weights"
    assert _max_diff(res[tag]["params"], ref) < 1e-5
    stats = res[tag]["exported"]
    if tag == "decoupled":  # capped behaviour weights drop some tokens
        assert 0.0 < stats["ppo_actor/update/behav_kept_ratio/avg"] < 1.0
        assert stats["ppo_actor/update/offpolicy/masked"] == pytest.approx(
            1.0 - stats["ppo_actor/update/behav_kept_ratio/avg"]
        )
    elif tag == "tis_free":  # truncated, none dropped; the 0.3-std logprob noise is the mismatch
        assert 0.0 < stats["ppo_actor/update/offpolicy/truncated"] < 1.0
        assert stats["ppo_actor/update/offpolicy/masked"] == 0.0
        assert stats["ppo_actor/update/importance_weight/avg"] == pytest.approx(1.0)
        assert 0.1 < stats["ppo_actor/update/offpolicy/abs_dlogp/avg"] < 0.4
        assert stats["ppo_actor/update/offpolicy/abs_dlogp/max"] > 0.5
        assert stats["ppo_actor/update/offpolicy/kl_k3"] > 0.0
        # Every token came from version 0, the engine's: no lag, no interrupted generation.
        assert stats["ppo_actor/offpolicy/version_lag/max"] == 0.0
        assert stats["ppo_actor/offpolicy/multi_version_tokens"] == 0.0
    elif tag == "none_recomputed":  # recomputed logprobs do not enter the ratio: the same step as "clipped"
        assert _max_diff(res[tag]["params"], res["clipped"]["params"]) < 1e-6
        assert stats["ppo_actor/update/clip_ratio/avg"] > 0.0
    else:  # stale logprobs: both clips fire
        assert stats["ppo_actor/update/clip_ratio/avg"] > 0.0
        assert stats["ppo_actor/update/dual_clip_ratio/avg"] > 0.0
        assert stats["ppo_actor/update/entropy/avg"] > 0.0


def test_compute_logp_equals_hf(results: tuple[dict, Path], tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    _, out = results
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for rank in (0, 1):
        saved = torch.load(out / f"logp_rank{rank}.pt")
        rows, logp = saved["rows"], saved["logp"]
        with torch.no_grad():
            for i, n in enumerate(rows["attention_mask"].sum(1).tolist()):
                ids = rows["input_ids"][i : i + 1, :n]
                lp = torch.log_softmax(model(input_ids=ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None])
                assert (logp[i, : n - 1] - lp.squeeze(-1)).abs().max().item() < 1e-5
                assert logp[i, n - 1 :].abs().max().item() == 0.0  # last token and padding


def test_recompute_skipped_exactly_when_on_policy_and_loss_unchanged(results: tuple[dict, Path]) -> None:
    rec = results[0]["recompute"]
    auto, always, stale = rec["auto"]["exported"], rec["always"]["exported"], rec["stale"]["exported"]
    # On-policy (every token from the engine's version): auto uses the server's logprobs, no forward.
    assert auto["actor/recompute_skipped"] == 1.0 and "timeperf/actor/recompute_logp" not in auto, sorted(auto)
    assert always["actor/recompute_skipped"] == 0.0 and always["timeperf/actor/recompute_logp"] > 0.0
    # Those logprobs are the trainer's own, so the loss and the update equal the recomputed ones (fp32).
    loss = "actor/ppo_actor/update/loss"
    assert auto[loss] == pytest.approx(always[loss], abs=1e-6, rel=1e-6) and auto[loss] != 0.0
    assert _max_diff(rec["auto"]["params"], rec["always"]["params"]) < 1e-6
    # One stale row on rank 1 only, a KL reward on: both ranks recompute (the forward is collective).
    assert stale["actor/recompute_skipped"] == 0.0 and stale["timeperf/actor/recompute_logp"] > 0.0
    # The same batch with no correction and no KL reward: the ratio is against the behaviour policy.
    stale_none = rec["stale_none"]["exported"]
    assert stale_none["actor/recompute_skipped"] == 1.0 and "timeperf/actor/recompute_logp" not in stale_none
    # With a correction on and one optimizer step, the training forward serves as the proximal policy.
    stale_tis = rec["stale_tis"]["exported"]
    assert stale_tis["actor/recompute_skipped"] == 1.0 and "timeperf/actor/recompute_logp" not in stale_tis
    # The engine timed its phases of train_batch.
    assert auto["timeperf/actor/ppo_actor/update/fwd_bwd"] > 0.0
    assert auto["timeperf/actor/ppo_actor/update/optimizer_step"] > 0.0


def test_minibatches_and_epochs_take_one_step_each(results: tuple[dict, Path], initial_params: dict) -> None:
    res, _ = results
    stats = res["multi"]["stats"]
    assert len(stats) == 4 and all(s["update_successful"] == 1.0 for s in stats)
    assert _max_diff(res["multi"]["params"], initial_params) > 1e-5


def test_reinforce_loss_and_update(results: tuple[dict, Path], tiny_model_dir: str, initial_params: dict) -> None:
    """ReinforceActor's loss is ``-w * A * log p`` at the sampling temperature (0.7), ``w = min(rho, 1.2)``
    on ``rho = exp(log p - behaviour log p)``: written out here on the global batch."""
    from transformers import AutoModelForCausalLM

    res, _ = results
    batch = res["batch"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    num, n_tok, at_t1 = 0.0, 0, 0.0
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            ids = batch["input_ids"][i, :n]
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
            resp = batch["loss_mask"][i, 1:n].bool()
            lp = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[1:, None]).squeeze(-1)[resp]
            behav = batch["logprobs"][i, 1:n][resp]
            w = torch.exp(lp - behav).clamp(max=1.2)
            num += float(-(w * float(batch["rewards"][i]) * lp).sum())
            at_t1 += float(
                -(float(batch["rewards"][i]) * torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[resp]).sum()
            )
            n_tok += len(lp)
    assert res["reinforce"]["stats"]["loss"] == pytest.approx(num / n_tok, rel=1e-5)
    assert abs(num - at_t1) / n_tok > 1e-3, "temperature 1 and no weights would give another loss"
    assert "offpolicy_correction 'none' on samples from older weights" in res["reinforce"]["stale_none"]
    assert _max_diff(res["reinforce"]["params"], initial_params) > 1e-5


def test_reinforce_step_raises_its_objective(results: tuple[dict, Path]) -> None:
    """After ReinforceActor's step, the REINFORCE objective sum_i r_i * w * log p(sample i) on the batch it
    trained on is higher (rank 0's rows; w fixed at its pre-step value): the update goes uphill."""
    scored = results[0]["reinforce"]["logp"]
    rows, before, after = scored["rows"], scored["before"], scored["after"]
    action = shift_left(rows["loss_mask"].bool(), fill=False) & rows["attention_mask"].bool()
    behav = server_logp(rows["logprobs"], action)
    w = torch.where(action, torch.exp(before - behav).clamp(max=1.2), 0.0)
    r = rows["rewards"].float()[:, None]
    j_before, j_after = float((r * w * before).sum()), float((r * w * after).sum())
    assert (r > 0).any() and j_after > j_before, (j_before, j_after)
    # Rows with reward 0 carry no gradient of their own; the rewarded rows' log-likelihood rose.
    rewarded = (r[:, 0] > 0)[:, None] & action
    assert float(after[rewarded].sum()) > float(before[rewarded].sum())


def test_critic_values_and_updates(results: tuple[dict, Path], tiny_model_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForTokenClassification

    res, _ = results
    crit = res["critic"]
    cfg = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1, classifier_dropout=0.0)
    model = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(crit["init_params"])
    model.eval()
    rows = crit["rows"]
    with torch.no_grad():
        for i, n in enumerate(rows["attention_mask"].sum(1).tolist()):
            v = model(input_ids=rows["input_ids"][i : i + 1, :n]).logits[0, :, 0]
            assert (crit["values"][i, :n] - v).abs().max().item() < 1e-5
    # GAE from the values: returns = advantages + values on actions (before normalization).
    act = rows["action_mask"]
    assert act.any() and torch.isfinite(rows["returns"]).all()
    losses = crit["losses"]
    assert losses[0] > losses[1] > losses[2], losses
