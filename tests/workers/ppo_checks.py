"""torchrun worker for the PPO actor tests: runs every check on 2 ranks, saves results to --out.

Rank 0 writes ``ppo.pt`` (the global batch, parameters after each update, stats); every rank
writes ``logp_rank{r}.pt`` (its compute_logp output and rows).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from tandemrl.algorithms.ppo import PPOActor, PPOCritic
from tandemrl.algorithms.reinforce import ReinforceActor
from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import NormConfig, PPOActorConfig, PPOCriticConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.teardown import destroy_process_groups

VOCAB = 1024
GROUP = 2
REINFORCE_TEMPERATURE = 0.7
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0]  # group 3 is uniform: zero GRPO advantage

# The two configurations compared with the single-process reference in tests/integration/test_ppo_actor.py.
CONFIGS = {
    # GRPO + decoupled PPO (asynchronous samples): ratio vs recomputed proximal logp,
    # behaviour weights exp(prox - behav) capped at 1.3.
    "decoupled": dict(
        adv_norm=NormConfig(mean_level="group", std_level="group", unit="sequence"),
        use_decoupled_loss=True,
        behav_imp_weight_cap=1.3,
        eps_clip=0.2,
        eps_clip_higher=0.28,
    ),
    # Plain PPO on stale behaviour logprobs (no recompute): asymmetric + dual clip,
    # group mean / batch std over tokens (needs the cross-rank sum), per-sequence loss mean, entropy.
    "clipped": dict(
        adv_norm=NormConfig(mean_level="group", std_level="batch", unit="token"),
        recompute_logprob="never",
        offpolicy_correction="none",  # the PPO clip against the behaviour policy is the only correction
        eps_clip=0.2,
        eps_clip_higher=0.3,
        c_clip=1.5,
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.01,
    ),
    # "clipped" with the proximal logprobs recomputed (ppo_step passes them unless 'never'): with no
    # correction the ratio stays against the behaviour policy, so the update equals "clipped".
    "none_recomputed": dict(
        adv_norm=NormConfig(mean_level="group", std_level="batch", unit="token"),
        offpolicy_correction="none",
        eps_clip=0.2,
        eps_clip_higher=0.3,
        c_clip=1.5,
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.01,
    ),
    # Token TIS without a recompute (recompute_logprob never, one step): the training forward is the
    # proximal policy, so the PPO ratio is 1 and each token weighs min(exp(prox - behav), 1.2).
    "tis_free": dict(
        adv_norm=NormConfig(mean_level="group", std_level="group", unit="sequence"),
        recompute_logprob="never",
        offpolicy_correction="tis",
        offpolicy_cap=1.2,
    ),
}


def hf_logprobs(model_dir: str, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Token-aligned log p(token t | < t) of each row under the plain HF model (0 at t = 0 and padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(input_ids.shape)
    with torch.no_grad():
        for i, n in enumerate(lens):
            ids = input_ids[i : i + 1, :n]
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            out[i, 1:n] = lp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return out


def make_rollout_batch(model_dir: str, seed: int = 7, n: int = 8, max_len: int = 24) -> dict[str, torch.Tensor]:
    """Random prompts + responses; behaviour logprobs = HF logprobs + noise (a slightly stale policy)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(10, max_len + 1, (n,), generator=g)
    lens[0] = max_len  # one full-length row: no padding after it
    prompt = torch.randint(3, 7, (n,), generator=g)
    pos = torch.arange(max_len)[None, :]
    am = pos < lens[:, None]
    loss_mask = am & (pos >= prompt[:, None])
    ids = torch.randint(3, VOCAB, (n, max_len), generator=g) * am
    noise = 0.3 * torch.randn(n, max_len, generator=g)
    logprobs = torch.where(loss_mask, hf_logprobs(model_dir, ids, lens.tolist()) + noise, 0.0)
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": loss_mask.long(),
        "logprobs": logprobs,
        "versions": torch.where(loss_mask, 0, -1),
        "rewards": torch.tensor(REWARDS),
    }


def rank_slice(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r, w = dist.get_rank(), dist.get_world_size()
    n = batch["input_ids"].shape[0] // w
    return {k: v[r * n : (r + 1) * n].clone() for k, v in batch.items()}


def build(model: str, lr: float = 1e-4, is_critic: bool = False) -> FSDPEngine:
    e = FSDPEngine(
        TrainEngineConfig(
            path=model,
            is_critic=is_critic,
            mixed_precision=None,
            optimizer=OptimizerConfig(lr=lr, gradient_clipping=1.0),
        )
    )
    e.create_process_group()
    e.initialize(None, None)
    return e


def actor_config(model: str, **fields: object) -> PPOActorConfig:
    return PPOActorConfig(engine=TrainEngineConfig(path=model, mixed_precision=None), group_size=GROUP, **fields)


def ppo_step(model: str, global_batch: dict[str, torch.Tensor], fields: dict) -> dict:
    e = build(model)
    actor = PPOActor(actor_config(model, **fields), e)
    batch = rank_slice(global_batch)
    prox = actor.compute_logp(batch)
    if actor.config.recompute_logprob != "never":
        batch["prox_logp"] = prox
    batch = actor.compute_advantages(batch)
    stats = actor.ppo_update(batch)
    exported = e.export_stats()
    out = {"params": e.full_state_dict(), "stats": stats, "exported": exported, "prox": prox}
    e.destroy()
    return out


def recompute_checks(model: str, global_batch: dict[str, torch.Tensor]) -> dict:
    """ppo_train_step with recompute_logprob auto vs always on an on-policy batch whose ``logprobs``
    are the trainer's own (so both must give the same loss), then auto on a batch with one stale row."""
    from tandemrl.trainers.rl_loop import ppo_train_step

    version = 3
    # No correction: the recompute decision rests on the versions alone (a correction on a one-step
    # update never recomputes; ``stale_tis`` below).
    fields = dict(adv_norm=CONFIGS["decoupled"]["adv_norm"], offpolicy_correction="none")
    out: dict[str, dict] = {}
    logprobs = None
    for mode in ("auto", "always"):
        e = build(model)
        e.set_version(version)
        actor = PPOActor(actor_config(model, recompute_logprob=mode, **fields), e)
        batch = rank_slice(global_batch)
        if logprobs is None:  # the trainer's logprobs, token-aligned like a server's
            nxt = actor.compute_logp(batch)
            logprobs = torch.zeros_like(nxt)
            logprobs[:, 1:] = nxt[:, :-1]
            logprobs = torch.where(batch["loss_mask"].bool(), logprobs, 0.0)
        batch["logprobs"] = logprobs
        batch["versions"] = torch.where(batch["loss_mask"].bool(), version, -1)
        ppo_train_step(actor)(batch, 0)
        out[mode] = {"exported": e.export_stats(), "params": e.full_state_dict()}
        if mode == "auto":  # one row on rank 1 came from the previous weights
            batch = rank_slice(global_batch)
            batch["versions"] = torch.where(batch["loss_mask"].bool(), version, -1)
            if dist.get_rank() == 1:
                batch["versions"][0] = torch.where(batch["loss_mask"][0].bool(), version - 1, -1)
            # No correction and no KL reward: nothing reads the proximal logprobs, no recompute.
            ppo_train_step(actor)(batch, 1)
            out["stale_none"] = {"exported": e.export_stats()}
            # A KL reward reads them: every rank recomputes (the forward is collective).
            kl = PPOActor(actor_config(model, recompute_logprob=mode, kl_ctl=0.01, **fields), e)
            ppo_train_step(kl, ref=kl)(batch, 1)
            out["stale"] = {"exported": e.export_stats()}
            # The same stale batch under token TIS (the default correction), one optimizer step: the
            # update's own forward is the proximal policy, so no recompute.
            tis = PPOActor(actor_config(model, adv_norm=fields["adv_norm"], offpolicy_correction="tis"), e)
            ppo_train_step(tis)(batch, 2)
            out["stale_tis"] = {"exported": e.export_stats()}
        e.destroy()
    return out


def main(args: argparse.Namespace) -> None:
    init_default_process_group()
    rank = dist.get_rank()
    global_batch = make_rollout_batch(args.model)
    results: dict[str, object] = {"batch": global_batch}

    for tag, fields in CONFIGS.items():
        res = ppo_step(args.model, global_batch, fields)
        torch.save(
            {"logp": res.pop("prox"), "rows": rank_slice(global_batch)}, os.path.join(args.out, f"logp_rank{rank}.pt")
        )
        results[tag] = res

    results["recompute"] = recompute_checks(args.model, global_batch)

    # Several minibatches and epochs: 2 x 2 optimizer steps.
    e = build(args.model)
    actor = PPOActor(actor_config(args.model, ppo_n_minibatches=2, ppo_n_epochs=2, eps_clip_higher=0.28), e)
    batch = rank_slice(global_batch)
    batch["prox_logp"] = actor.compute_logp(batch)
    batch = actor.compute_advantages(batch)
    results["multi"] = {"stats": actor.ppo_update(batch), "params": e.full_state_dict()}
    e.destroy()

    # REINFORCE on per-sequence rewards (e.g. ReMax reward differences), at the sampling temperature
    # 0.7 with token TIS (C = 1.2) on the noisy behaviour logprobs.
    e = build(args.model)
    cfg = actor_config(args.model, temperature=REINFORCE_TEMPERATURE, offpolicy_correction="tis", offpolicy_cap=1.2)
    local = rank_slice(global_batch)
    scorer = PPOActor(cfg, e)  # compute_logp at the sampling temperature, to score the objective
    before = scorer.compute_logp(local)
    stats = ReinforceActor(cfg, e).train_reinforce(local)
    results["reinforce"] = {"stats": stats, "params": e.full_state_dict()}
    results["reinforce"]["logp"] = {"before": before, "after": scorer.compute_logp(local), "rows": local}
    # No correction on samples one version behind the trainer: refused, not trained as on-policy.
    stale = rank_slice(global_batch)
    stale["versions"] = torch.where(stale["loss_mask"].bool(), e.get_version() - 1, -1)
    try:
        ReinforceActor(actor_config(args.model, offpolicy_correction="none"), e).train_reinforce(stale)
        results["reinforce"]["stale_none"] = "trained"
    except ValueError as err:
        results["reinforce"]["stale_none"] = str(err)
    e.destroy()

    # Critic: values, GAE advantages from them, three clipped value-loss updates.
    e = build(args.model, lr=1e-5, is_critic=True)
    critic = PPOCritic(PPOCriticConfig(engine=e.config, group_size=GROUP, eps_clip_value=0.5), e)
    batch = rank_slice(global_batch)
    init_params = e.full_state_dict()
    batch["values"] = critic.compute_values(batch)
    batch = PPOActor(actor_config(args.model, discount=0.9, gae_lambda=0.95), e).compute_advantages(batch)
    losses = [critic.ppo_update(batch)[0]["loss"] for _ in range(3)]
    results["critic"] = {"init_params": init_params, "values": batch["values"], "rows": batch, "losses": losses}
    e.destroy()

    if rank == 0:
        torch.save(results, os.path.join(args.out, "ppo.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    main(a)
    destroy_process_groups()
