"""PPO-family actor and critic, written once against the TrainEngine contract (any backend).

``PPOActor(config.actor, engine)`` / ``PPOCritic(config.critic, engine)`` take an engine built
by ``tandemrl.engines.registry.make_engine``. Input: a :class:`~tandemrl.api.types.RolloutBatch`.
The fields they add are declared in :class:`PPOBatch`; each is next-token (action) aligned like
the logits: ``x[:, t]`` is about emitting token t + 1 from the prefix ``<= t`` (see
:mod:`tandemrl.algorithms.layout`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from tandemrl.algorithms.advantages import gae, groups_with_signal, normalization_stats, normalize_advantages
from tandemrl.algorithms.aggregation import aggregate_loss, aggregation_weight
from tandemrl.algorithms.constrained import behaviour_for_weights, forced_actions, limited_actions, mostly_forced
from tandemrl.algorithms.kl import kl_estimate, kl_penalty_rewards
from tandemrl.algorithms.layout import shift_left
from tandemrl.algorithms.offpolicy import (
    Correction,
    mismatch_token_stats,
    old_policy_logp,
    resolve_correction,
    version_stats,
)
from tandemrl.algorithms.policy_loss import entropy_bonus, ppo_policy_loss
from tandemrl.algorithms.recompute import RECOMPUTE_MODES, needs_logp_recompute, server_logp
from tandemrl.algorithms.rewards import (
    apply_no_eos_penalty,
    overlong_penalty,
    place_at_last_token,
    response_ends_with_eos,
    shape_rewards,
)
from tandemrl.algorithms.truncation import Truncation, policy_logprobs, replay_of
from tandemrl.algorithms.value_loss import value_loss
from tandemrl.api.engine import LossFn, TrainEngine
from tandemrl.api.types import ROUTED_EXPERTS, RolloutBatch, TensorDict
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.models.functional import next_token_labels
from tandemrl.utils import stats_tracker
from tandemrl.utils.stats_tracker import ReduceType

logger = logging.getLogger(__name__)


class PPOBatch(RolloutBatch, total=False):
    """A rollout batch plus the fields of the PPO family, all [B, L] next-token aligned unless noted."""

    prox_logp: torch.Tensor  # the trainer's policy before the update (PPOActor.proximal_logp, when recomputed)
    ref_logp: torch.Tensor  # PPOActor.compute_logp on the reference engine
    values: torch.Tensor  # PPOCritic.compute_values
    # Written by PPOActor.compute_advantages:
    action_mask: torch.Tensor  # positions whose next token is generated (and kept)
    forced_mask: torch.Tensor  # generated tokens an output constraint forced, out of action_mask (constrained.py)
    limited_mask: torch.Tensor  # actions an output constraint limited (not forced): weigh 1 (constrained.py)
    behav_logp: torch.Tensor  # the rollout ``logprobs`` shifted left by one
    shaped_rewards: torch.Tensor  # [B] sequence rewards after penalties, scaling and clipping
    token_rewards: torch.Tensor  # shaped reward at the last action + KL rewards
    kl_rewards: torch.Tensor  # -kl_ctl * KL per action (0 with use_kl_loss)
    advantages: torch.Tensor  # GAE, normalized per config.adv_norm
    returns: torch.Tensor  # GAE returns, before normalization


def require_fields(batch: TensorDict | RolloutBatch, names: tuple[str, ...], where: str, hint: str = "") -> None:
    """One-line error naming the first missing batch field."""
    for name in names:
        if name not in batch:
            raise KeyError(f"{where}: batch has no '{name}'{hint} (fields: {sorted(batch)})")


def record_routing(engine: TrainEngine, batch: TensorDict | RolloutBatch) -> None:
    """MoE routing replay (docs/moe.md): with the engine's ``router_replay`` on and no ``routed_experts`` in
    ``batch`` yet, one forward at the current (pre-update) weights records them into ``batch``."""
    if not engine.router_replay or ROUTED_EXPERTS in batch:
        return
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    engine.forward(inputs, post_hook=lambda logits, mb: logits[:, :1].detach())  # the routing is the output
    batch[ROUTED_EXPERTS] = inputs[ROUTED_EXPERTS]


def correction_of(config: PPOActorConfig) -> Correction:
    """The off-policy correction ``config`` asks for (``offpolicy_correction`` and its fields)."""
    return resolve_correction(
        config.offpolicy_correction,
        config.offpolicy_cap,
        config.offpolicy_cap_low,
        config.offpolicy_seq_ratio,
        config.use_decoupled_loss,
        config.behav_imp_weight_cap,
    )


def action_mask_of(batch: TensorDict | RolloutBatch) -> torch.Tensor:
    """Next-token aligned mask of positions whose next token is generated (``loss_mask`` shifted left)."""
    return shift_left(batch["loss_mask"].bool() & batch["attention_mask"].bool(), fill=False)


def split_minibatches(batch: TensorDict, n: int, group_size: int) -> list[TensorDict]:
    """``n`` contiguous minibatches of whole groups (``group_size`` consecutive rows each)."""
    bsz = batch["attention_mask"].shape[0]
    if group_size < 1 or bsz % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide this rank's batch of {bsz} sequences")
    n_groups = bsz // group_size
    if not 1 <= n <= n_groups:
        raise ValueError(f"ppo_n_minibatches={n} must be in [1, {n_groups}] (groups in this rank's batch)")
    cuts = [round(i * n_groups / n) * group_size for i in range(n + 1)]
    return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def next_token_logp(
    logits: torch.Tensor, mb: TensorDict, temperature: float, replay: Truncation | None = None
) -> torch.Tensor:
    """Post-hook: packed next-token logprobs (under ``replay``'s truncation if given), 0 at each
    sequence's last position (no next token)."""
    labels = next_token_labels(mb["input_ids"], mb["cu_seqlens"])
    logp = policy_logprobs(logits, labels, temperature, replay)[0]
    logp[mb["cu_seqlens"][1:].long() - 1] = 0.0
    return logp


class PPOActor:
    """compute_logp / compute_advantages / ppo_update for every PPO-family algorithm (see PPOActorConfig)."""

    def __init__(self, config: PPOActorConfig, engine: TrainEngine):
        norm = config.adv_norm
        if config.group_size < 1:
            raise ValueError(f"PPOActorConfig.group_size must be >= 1, got {config.group_size}")
        if "group" in (norm.mean_level, norm.std_level) and config.group_size == 1:
            raise ValueError("PPOActorConfig.adv_norm: group-level statistics need group_size > 1")
        if config.overlong_buffer > 0 and config.max_new_tokens is None:
            raise ValueError("PPOActorConfig.max_new_tokens must be set when overlong_buffer > 0")
        if config.recompute_logprob not in RECOMPUTE_MODES:
            raise ValueError(
                f"PPOActorConfig.recompute_logprob: '{config.recompute_logprob}' is not one of "
                f"{', '.join(RECOMPUTE_MODES)}"
            )
        if config.use_decoupled_loss and config.recompute_logprob == "never":
            raise ValueError(
                "PPOActorConfig.recompute_logprob: 'never' cannot serve use_decoupled_loss "
                "(off-policy batches need the recomputed proximal policy); use 'auto'"
            )
        self.correction = correction_of(config)
        if self.correction.kind == "cispo" and config.c_clip is not None:
            raise ValueError("PPOActorConfig.c_clip: the dual clip has no effect with offpolicy_correction 'cispo'")
        # One optimizer step per batch: that step's training forward runs at the proximal weights.
        self.one_step = config.ppo_n_minibatches * config.ppo_n_epochs == 1
        if self.correction.active and not self.one_step and config.recompute_logprob == "never":
            raise ValueError(
                f"PPOActorConfig.recompute_logprob: 'never' leaves offpolicy_correction "
                f"'{self.correction.kind}' no proximal policy when an update takes several steps "
                "(ppo_n_minibatches * ppo_n_epochs > 1); use 'auto' or offpolicy_correction: none"
            )
        self.config = config
        self.engine = engine
        self.replay = replay_of(config)  # truncated sampling replayed in every trainer logprob (truncation.py)

    # ------------------------------------------------------------------ logp
    def compute_logp(self, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs [B, L] of the current weights at ``config.temperature``, next-token aligned.

        ``logp[:, t] = log p(input_ids[:, t + 1] | input_ids[:, : t + 1])``; 0 at each
        sequence's last token and on padding. Use it as ``batch["prox_logp"]`` (before an
        update) or, from a reference engine, as ``batch["ref_logp"]``.
        """
        require_fields(batch, ("input_ids", "attention_mask"), "compute_logp")
        temp, replay = self.config.temperature, self.replay
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        # MoE routing replay (docs/moe.md): replay the batch's routing, or record it in this forward.
        routing = self.engine.router_replay
        if routing and ROUTED_EXPERTS in batch:
            inputs[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS]
        logp = self.engine.forward(inputs, post_hook=lambda logits, mb: next_token_logp(logits, mb, temp, replay))
        if routing:
            batch[ROUTED_EXPERTS] = inputs[ROUTED_EXPERTS]
        return logp

    def proximal_logp(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``batch["prox_logp"]`` for the update: the trainer's policy before it, next-token aligned like ``compute_logp``.

        Recomputed (one forward) when ``config.recompute_logprob`` asks for it
        (:func:`~tandemrl.algorithms.recompute.needs_logp_recompute`; ``auto``: some generated
        token came from weights older than ``engine.get_version()``, or a mismatch correction
        needs it because the update takes several optimizer steps; never for a one-step update
        with a correction on and no KL reward, whose training forward is the proximal policy);
        else None: the update uses
        the server's logprobs as its old policy, and an active correction takes the trainer's
        from the update's own (single) training forward. The data-parallel ranks decide
        together (a stale token on any rank recomputes on all). Records ``recompute_skipped``
        (1: no recompute) and ``timeperf/.../recompute_logp``.
        """
        require_fields(batch, ("input_ids", "attention_mask", "loss_mask", "logprobs"), "proximal_logp")
        versions = batch["versions"] if "versions" in batch else None
        version = self.engine.get_version()
        cfg = self.config
        local = needs_logp_recompute(cfg.recompute_logprob, versions, batch["loss_mask"], version)
        local = local or (self.correction.active and not self.one_step)
        # 'auto' skips it where nothing would read it: with no correction the ratio's old policy is
        # the behaviour policy (old_policy_logp), and with a correction over one optimizer step the
        # update's own forward runs at the proximal weights. A KL reward reads prox_logp either way.
        kl_reward = cfg.kl_ctl > 0 and not cfg.use_kl_loss
        unread = not self.correction.active or self.one_step
        if cfg.recompute_logprob == "auto" and unread and not kl_reward:
            local = False
        recompute = bool(self._dp_sum(torch.tensor([float(local)])).item() > 0)
        stats_tracker.scalar(recompute_skipped=float(not recompute))
        if recompute:
            with stats_tracker.record_timing("recompute_logp"):
                return self.compute_logp(batch)
        return None

    # ------------------------------------------------------------ advantages
    def _model_path(self) -> str:
        """The policy's model directory: the one the engine loaded, else ``config.engine``'s."""
        return self.engine.model_path or self.config.engine.path

    def _eos_ids(self) -> list[int]:
        if self.config.eos_token_ids:
            return list(self.config.eos_token_ids)
        from transformers import AutoConfig

        path = self._model_path()
        eos = AutoConfig.from_pretrained(path).eos_token_id
        if eos is None:
            raise ValueError(f"PPOActorConfig.eos_token_ids: empty and the model at {path} has none")
        return [eos] if isinstance(eos, int) else list(eos)

    def truncated_rows(self, batch: TensorDict) -> torch.Tensor:
        """Bool [B]: rows whose response does not end with an EOS/stop token, which ``mask_no_eos`` leaves out of the loss."""
        return ~response_ends_with_eos(batch["input_ids"], batch["loss_mask"], self._eos_ids())

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (for batch-level advantage statistics)."""
        if not dist.is_initialized() or self.engine.data_parallel_world_size <= 1:
            return t
        group = self.engine.data_parallel_group
        on = self.engine.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        x = t.to(on)
        dist.all_reduce(x, group=group)
        return x.to(t.device)

    def _normalize(self, adv: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        norm = self.config.adv_norm
        if norm.mean_level == "none" and norm.std_level == "none":
            return adv
        kw: dict[str, Any] = {
            "group_size": self.config.group_size,
            "mean_level": norm.mean_level,
            "std_level": norm.std_level,
            "leave_one_out": norm.leave_one_out,
            "unbiased": norm.std_unbiased,
            "eps": norm.eps,
            "all_reduce": self._dp_sum,
        }
        if norm.unit == "token":
            return normalize_advantages(adv, action, **kw)
        # One value per sequence: its return at the first generated token.
        first = action.float().argmax(dim=1, keepdim=True)
        baseline, scale = normalization_stats(adv.gather(1, first).squeeze(1), action.any(dim=1), **kw)
        return torch.where(action, (adv - baseline[:, None]) / scale[:, None], 0.0)

    def compute_advantages(self, batch: PPOBatch) -> PPOBatch:
        """Shape rewards, add KL rewards, run GAE and normalize; a new batch with the fields of :class:`PPOBatch`.

        ``batch`` itself is not changed.

        Sequence rewards: no-EOS penalty (replaces the reward), + DAPO overlong penalty, then
        ``clamp((r + reward_bias) * reward_scaling, +-reward_clip)``; placed at the last
        generated token. KL reward ``-kl_ctl * kl(prox_logp or behaviour, ref_logp)`` on every
        generated token unless ``use_kl_loss``. GAE uses ``batch["values"]`` if present (critic),
        else 0 (then ``advantage = reward-to-go``). ``returns`` are taken before normalization.
        """
        cfg = self.config
        require_fields(batch, ("input_ids", "attention_mask", "loss_mask", "logprobs", "rewards"), "compute_advantages")
        bsz = batch["attention_mask"].shape[0]
        if tuple(batch["rewards"].shape) != (bsz,):
            raise ValueError(f"batch field 'rewards' must be per-sequence [{bsz}], got {tuple(batch['rewards'].shape)}")
        action = action_mask_of(batch)
        forced = forced_actions(batch, action)  # tokens an output constraint forced: no policy choice
        if forced is not None:
            record_forced(forced, action, self._dp_sum)
            action = action & ~forced
        limited = limited_actions(batch, action)  # the other tokens of constrained calls
        if limited is not None:
            with stats_tracker.scope("ppo_actor"), stats_tracker.scope("offpolicy"):
                stats_tracker.denominator(n_actions=action)
                stats_tracker.stat("n_actions", ReduceType.AVG, limited=limited.float())
        behav = server_logp(batch["logprobs"], action)
        rewards = batch["rewards"].float().to(action.device)
        if cfg.mask_no_eos or cfg.no_eos_penalty is not None:
            ended = response_ends_with_eos(batch["input_ids"], batch["loss_mask"], self._eos_ids())
            if cfg.no_eos_penalty is not None:
                rewards = apply_no_eos_penalty(rewards, ended, cfg.no_eos_penalty)
            if cfg.mask_no_eos:
                action = action & ended[:, None]
        if cfg.overlong_buffer > 0:
            lengths = batch["loss_mask"].bool().sum(dim=1)
            assert cfg.max_new_tokens is not None  # __init__ refuses overlong_buffer > 0 without it
            rewards = rewards + overlong_penalty(
                lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor
            )
        rewards = shape_rewards(rewards, cfg.reward_scaling, cfg.reward_bias, cfg.reward_clip)

        kl_rewards = torch.zeros_like(behav)
        if cfg.kl_ctl > 0 and not cfg.use_kl_loss:
            require_fields(batch, ("ref_logp",), "compute_advantages", " (kl_ctl > 0 needs reference logprobs)")
            prox = batch.get("prox_logp")
            policy_logp = behav if prox is None else prox
            kl_rewards = kl_penalty_rewards(policy_logp, batch["ref_logp"], action, cfg.kl_ctl, cfg.kl_estimator)
        token_rewards = place_at_last_token(rewards, action) + kl_rewards
        values = torch.where(action, batch["values"].float(), 0.0) if "values" in batch else torch.zeros_like(behav)
        adv, returns = gae(token_rewards, values, action, cfg.discount, cfg.gae_lambda)
        added = {
            "action_mask": action,
            "behav_logp": behav,
            "shaped_rewards": rewards,
            "token_rewards": token_rewards,
            "kl_rewards": kl_rewards,
            "advantages": self._normalize(adv, action),
            "returns": returns,
        }
        if forced is not None:
            added["forced_mask"] = forced
        if limited is not None:
            added["limited_mask"] = limited
        return cast(PPOBatch, {**batch, **added})

    # ---------------------------------------------------------------- update
    def _loss(
        self,
        logits: torch.Tensor,
        mb: TensorDict,
        forward_is_proximal: bool = False,
        mismatch: bool = True,
    ) -> torch.Tensor:
        """PPO loss of one micro-batch. ``forward_is_proximal``: this step's weights are the proximal
        policy (one-step update without a recompute), so the detached ``logp`` is the old policy;
        ``mismatch``: record the trainer-vs-server metrics, from ``prox_logp`` when it was recomputed
        else from this forward (each token once per update)."""
        cfg = self.config
        cu = mb["cu_seqlens"]
        labels = next_token_labels(mb["input_ids"], cu)
        logp, entropy, outside = policy_logprobs(logits, labels, cfg.temperature, self.replay, cfg.entropy_coeff != 0.0)
        mask = mb["action_mask"].bool()
        old = logp.detach() if forward_is_proximal else mb["old_logp"]
        trainer = mb["prox_logp"] if "prox_logp" in mb else logp.detach()
        limited = mb.get("limited_mask")
        behav = behaviour_for_weights(mb["behav_logp"], trainer, limited)  # constrained tokens weigh 1
        if not self.correction.active:  # the ratio's old policy is the behaviour one: the same exclusion
            old = behaviour_for_weights(old, trainer, limited)
        agg: dict[str, Any] = {"agg_mode": cfg.loss_agg_mode, "cu_seqlens": cu, "agg_norm_len": cfg.loss_agg_norm_len}
        loss, st = ppo_policy_loss(
            logp,
            old,
            mb["advantages"],
            mask,
            cfg.eps_clip,
            cfg.eps_clip_higher,
            cfg.c_clip,
            behav_logp=behav,
            ratio_level=cfg.importance_sampling_level,
            correction=self.correction,
            **agg,
        )
        stats_tracker.denominator(n_action_tokens=mask)
        stats_tracker.stat(
            denominator="n_action_tokens",
            importance_weight=st["ratio"],
            approx_kl=st["approx_kl"],
            clip_ratio=st["clip_mask"].float(),
            dual_clip_ratio=st["dual_clip_mask"].float(),
            new_logp=logp.detach(),
        )
        if outside is not None:
            stats_tracker.stat(denominator="n_action_tokens", truncation_outside_frac=outside.float())
        if self.correction.active:
            stats_tracker.stat(
                denominator="n_action_tokens",
                behav_imp_weight=st["behav_imp_weight"],
                behav_kept_ratio=st["behav_kept"].float(),
            )
        exact = None if limited is None else mask & ~limited.bool()  # mismatch: the tokens both sides score alike
        _record_correction(st, mask, mb["behav_logp"], trainer if mismatch else None, exact)
        if entropy is not None:
            loss = loss + entropy_bonus(entropy, mask, cfg.entropy_coeff, **agg)
            stats_tracker.stat(denominator="n_action_tokens", entropy=entropy.detach())
        if cfg.kl_ctl > 0 and cfg.use_kl_loss:
            kl = kl_estimate(logp, mb["ref_logp"], cfg.kl_estimator)
            loss = loss + cfg.kl_ctl * aggregate_loss(kl, mask, cfg.loss_agg_mode, cu, cfg.loss_agg_norm_len)
            stats_tracker.stat(denominator="n_action_tokens", kl=kl.detach())
        return loss

    def _record_batch(self, batch: PPOBatch) -> None:
        action = batch["action_mask"].bool()
        stats_tracker.denominator(n_seqs=torch.ones_like(action[:, 0]), n_generated_tokens=action)
        stats_tracker.stat(
            denominator="n_seqs",
            shaped_reward=batch["shaped_rewards"].float(),
            response_len=action.sum(dim=1).float(),
        )
        stats_tracker.stat(
            denominator="n_generated_tokens",
            advantages=batch["advantages"],
            returns=batch["returns"],
            kl_rewards=batch["kl_rewards"],
        )
        signal = groups_with_signal(batch["advantages"], action, self.config.group_size)
        stats_tracker.denominator(n_groups=torch.ones_like(signal))
        stats_tracker.stat("n_groups", ReduceType.AVG, groups_with_signal=signal.float())
        if "versions" in batch:  # staleness per sample, and generations that spanned a weight update
            vs = version_stats(shift_left(batch["versions"], fill=-1), action, self.engine.get_version())
            with stats_tracker.scope("offpolicy"):
                stats_tracker.denominator(n_seqs=vs["has_tokens"], n_tokens=action)
                stats_tracker.stat("n_seqs", version_lag=vs["lag"])
                stats_tracker.stat("n_tokens", ReduceType.AVG, multi_version_tokens=vs["multi_version"].float())

    def ppo_update(self, batch: PPOBatch) -> list[dict[str, float]]:
        """``ppo_n_epochs`` passes over ``ppo_n_minibatches`` minibatches (whole groups); one optimizer step each,
        one trainer step in all (``engine.train_minibatches``: the LR schedule advances once, after the last).

        The ratio's old policy (:func:`~tandemrl.algorithms.offpolicy.old_policy_logp`) is the
        behaviour logprobs when ``offpolicy_correction`` is ``none`` (PPO against the sampler,
        stale or not), else ``prox_logp`` when present (:meth:`proximal_logp`), else the training
        forward's own logprobs (a one-step update). ``config.offpolicy_correction`` weights each token by
        its trainer/server ratio (:mod:`~tandemrl.algorithms.offpolicy`). Returns the engine's
        stats of every step; per-token stats go to ``stats_tracker`` under ``ppo_actor/``, the
        mismatch metrics under ``ppo_actor/offpolicy/`` (staleness) and ``ppo_actor/update/offpolicy/``.
        """
        cfg = self.config
        hint = " (batch = compute_advantages(batch) first)"
        require_fields(batch, ("advantages", "action_mask", "behav_logp", "returns"), "ppo_update", hint)
        prox = batch.get("prox_logp")
        if prox is None and self.correction.active and not self.one_step:
            kind = self.correction.kind
            hint = f" (offpolicy_correction '{kind}' over several steps: batch['prox_logp'] = proximal_logp(batch))"
            require_fields({}, ("prox_logp",), "ppo_update", hint)
        data = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "action_mask": batch["action_mask"],
            "advantages": batch["advantages"],
            "old_logp": old_policy_logp(self.correction, batch["behav_logp"], prox),
            "behav_logp": batch["behav_logp"],
        }
        if prox is not None:
            data["prox_logp"] = prox
        if "limited_mask" in batch:
            data["limited_mask"] = batch["limited_mask"]
        if cfg.kl_ctl > 0 and cfg.use_kl_loss:
            require_fields(batch, ("ref_logp",), "ppo_update", " (use_kl_loss needs reference logprobs)")
            data["ref_logp"] = batch["ref_logp"]
        if self.engine.router_replay:
            record_routing(self.engine, batch)  # unless the proximal recompute recorded them already
            data[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS]
        mode = cfg.loss_agg_mode

        def weight(mb: TensorDict) -> int:
            return aggregation_weight(mb["action_mask"], mode, mb["cu_seqlens"])

        free_prox = prox is None and self.correction.active  # one_step here (checked above)

        def steps() -> Iterator[tuple[TensorDict, LossFn]]:
            for epoch in range(cfg.ppo_n_epochs):
                for i, mb in enumerate(split_minibatches(data, cfg.ppo_n_minibatches, cfg.group_size)):
                    # Each token's mismatch once: the first epoch (recomputed), else the first step.
                    first = epoch == 0 and (prox is not None or i == 0)
                    yield mb, functools.partial(self._loss, forward_is_proximal=free_prox, mismatch=first)

        self.engine.train()
        with stats_tracker.scope("ppo_actor"):
            self._record_batch(batch)
            with stats_tracker.scope("update"):
                return self.engine.train_minibatches(steps(), weight)


class PPOCritic:
    """Value model (engine built with ``is_critic=True``): compute_values and a clipped value-loss update."""

    def __init__(self, config: PPOCriticConfig, engine: TrainEngine):
        if not config.engine.is_critic:
            raise ValueError("PPOCritic: config.engine.is_critic must be true so the engine builds a value head")
        self.config = config
        self.engine = engine

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Values [B, L]: ``values[:, t] = V(input_ids[:, : t + 1])``, the state before the action at t."""
        require_fields(batch, ("input_ids", "attention_mask"), "compute_values")
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return self.engine.forward(inputs, post_hook=lambda logits, mb: _values_of(logits))

    def _loss(self, logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        mask = mb["action_mask"].bool()
        loss, st = value_loss(_values_of(logits), mb["old_values"], mb["returns"], mask, self.config.eps_clip_value)
        stats_tracker.denominator(n_action_tokens=mask)
        stats_tracker.stat(
            denominator="n_action_tokens", value_clip_ratio=st["clip_mask"].float(), value_error=st["error"]
        )
        return loss

    def ppo_update(self, batch: PPOBatch) -> list[dict[str, float]]:
        """Fit ``returns`` (from the actor's compute_advantages) starting from ``values``; one optimizer step per
        minibatch and epoch, one trainer step of the critic's LR schedule in all."""
        cfg = self.config
        hint = " (set batch['values'] = compute_values(batch), then batch = actor.compute_advantages(batch))"
        require_fields(batch, ("values", "returns", "action_mask"), "PPOCritic.ppo_update", hint)
        data = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "action_mask": batch["action_mask"],
            "returns": batch["returns"],
            "old_values": batch["values"],
        }
        minibatches = split_minibatches(data, cfg.ppo_n_minibatches, cfg.group_size)
        steps = [(mb, self._loss) for _ in range(cfg.ppo_n_epochs) for mb in minibatches]
        self.engine.train()
        with stats_tracker.scope("ppo_critic"):  # one trainer step of the critic's schedule
            return self.engine.train_minibatches(steps, lambda m: int(m["action_mask"].sum()))


def _record_correction(
    st: dict[str, torch.Tensor],
    mask: torch.Tensor,
    behav_logp: torch.Tensor,
    trainer_logp: torch.Tensor | None,
    exact: torch.Tensor | None = None,
) -> None:
    """``offpolicy/``: fractions of tokens the correction dropped / truncated, of log-ratios clamped
    and of tokens dropped as not finite; given the trainer's proximal logp, mean/max
    |trainer - server| logp and KL(behaviour || trainer) (k3), over ``exact`` when given (the tokens of
    unconstrained calls: a constrained call's server logprob is of another distribution, constrained.py)."""
    with stats_tracker.scope("offpolicy"):
        stats_tracker.denominator(n_tokens=mask)
        dropped = (mask & ~st["behav_kept"]).float()
        stats_tracker.stat("n_tokens", ReduceType.AVG, masked=dropped, truncated=st["behav_truncated"].float())
        # The overflow guard of ppo_policy_loss: log-ratios clamped, tokens dropped as not finite.
        stats_tracker.stat(
            "n_tokens", ReduceType.AVG, ratio_clamped=st["ratio_clamped"].float(), nonfinite=st["nonfinite"].float()
        )
        if trainer_logp is not None:
            den = "n_tokens"
            if exact is not None:
                den = "n_unconstrained"
                stats_tracker.denominator(n_unconstrained=exact)
            mm = mismatch_token_stats(trainer_logp, behav_logp, mask if exact is None else exact)
            stats_tracker.stat(den, abs_dlogp=mm["abs_dlogp"])
            stats_tracker.stat(den, ReduceType.AVG, kl_k3=mm["kl_k3"])


def record_forced(
    forced: torch.Tensor, generated: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """``ppo_actor/offpolicy/forced``: the fraction of ``generated`` tokens an output constraint forced;
    one warning (data-parallel rank 0) when most of the batch, over all ranks (``all_reduce``), was."""
    with stats_tracker.scope("ppo_actor"), stats_tracker.scope("offpolicy"):
        stats_tracker.denominator(n_generated=generated)
        stats_tracker.stat("n_generated", ReduceType.AVG, forced=forced.float())
    n_forced, n_generated = all_reduce(torch.stack([forced.sum(), generated.sum()]).float()).tolist()
    if mostly_forced(n_forced, n_generated) and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "%d of %d generated tokens of this batch were forced by an output constraint (structured outputs) "
            "and are left out of the update; see docs/agents.md#constrained-outputs",
            n_forced,
            n_generated,
        )


def _values_of(logits: torch.Tensor) -> torch.Tensor:
    if logits.shape[-1] != 1:
        raise ValueError(f"PPOCritic: model outputs {logits.shape[-1]} values per token; build it with is_critic=True")
    return logits[..., 0].float()
