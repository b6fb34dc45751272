"""torchrun worker for the MoE routing replay test (tests/integration/test_router_replay.py): fp32, ``--alloc``
``megatron:d1`` on one gloo rank or ``megatron:d2e2`` (experts split over 2 ranks) on two; rank 0 reports.

The tiny Qwen3-MoE on ``megatron:d1`` with ``megatron.router_replay``: a forward at the behaviour weights
records ``routed_experts``; every later forward replays it, while hooks on megatron's routers capture the
routing each forward actually used (its ``routing_map``). Then ``STEPS`` policy-gradient-like updates on
the sampled tokens (replayed routing) that move only the routers (``--router-only 1``, the default: in this
tiny random model the experts' outputs are small, so whole-model updates move the logprobs mostly by
themselves and hide the routing's share), after which the same tokens' logprobs are measured with the
recorded routing replayed and with free routing, against the behaviour logprobs. Writes ``replay.pt``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from fsdp_checks import make_batch

from tandemrl.api.types import ROUTED_EXPERTS, FinetuneSpec
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.megatron.engine import MegatronEngine
from tandemrl.engines.megatron.routing import routing_map_to_indices
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.functional import gather_logprobs, next_token_labels

STEPS = 4
LR = 1e-3  # router-only updates at this lr change the top-k of ~30% of (token, layer) pairs within STEPS


def build(model: str, lr: float = LR, alloc: str = "") -> MegatronEngine:
    """An fp32 engine on ``--alloc``; every DP rank gets the whole batch (the same data on each)."""
    cfg = TrainEngineConfig(
        path=model,
        mixed_precision=None,
        mb_spec=MicroBatchSpec(n_mbs=2),
        optimizer=OptimizerConfig(lr=lr, gradient_clipping=1.0),
    )
    cfg.megatron.router_replay = True
    e = MegatronEngine(cfg)
    e.create_process_group(parse_allocation(alloc or ARGS.alloc).train.strategy)
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=STEPS, train_batch_size=1))
    return e


class RoutingProbe:
    """Forward hooks on the engine's routers: the [T, k] experts each layer used, per forward, in call order."""

    def __init__(self, e: MegatronEngine):
        self.k = e.model_config.num_experts_per_tok
        self.calls: list[tuple[int, torch.Tensor]] = []
        for layer, router in e._routers.routers.items():
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            self.calls.append((layer, routing_map_to_indices(output[1].detach().cpu(), self.k)))

        return hook

    def take(self) -> list[tuple[int, torch.Tensor]]:
        out, self.calls = self.calls, []
        return out


def freeze_all_but_routers(e: MegatronEngine) -> int:
    """Zero the gradient of every parameter but the routers' (Adam then leaves them as they are): the
    updates change which experts tokens go to, not what the experts compute. Returns the router parameter count."""
    router_params = {id(r.weight) for r in e._routers.routers.values()}
    for param in e.module.parameters():
        if id(param) not in router_params:
            param.register_hook(torch.zeros_like)
    return len(router_params)


def logp_of(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return gather_logprobs(logits, next_token_labels(mb["input_ids"], mb["cu_seqlens"]))


def pg_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """A REINFORCE-like loss on the sampled tokens with fixed per-token advantages (moves every weight)."""
    mask = mb["action_mask"].float()
    return -(logp_of(logits, mb) * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1)


def packed_routing(batch: dict[str, torch.Tensor], routed: torch.Tensor, plan: Any) -> list[torch.Tensor]:
    """The recorded [B, L, n_layers, k] routing packed like the engine's micro-batches: [T, n_layers, k] each."""
    mask = batch["attention_mask"].bool()
    return [routed[g][mask[g]] for g in plan.groups if g]


def ppo_section(model: str, batch: dict[str, torch.Tensor], behav: torch.Tensor) -> dict[str, Any]:
    """PPOActor on a fresh engine (the behaviour weights again): ``ppo_update`` on a rollout batch without
    ``routed_experts`` records them once before its first step, and both minibatches' training forwards
    (the second after an optimizer step) replay them."""
    from tandemrl.algorithms.ppo import PPOActor, split_minibatches
    from tandemrl.configs.ppo import PPOActorConfig

    e = build(model)
    probe = RoutingProbe(e)
    actor = PPOActor(PPOActorConfig(engine=e.config, group_size=4, ppo_n_minibatches=2, offpolicy_correction="none"), e)
    loss_mask = batch["loss_mask"]
    rollout = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "loss_mask": loss_mask,
        "logprobs": torch.zeros_like(behav).float(),
        "versions": torch.where(loss_mask.bool(), 0, -1),
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]),
    }
    rollout["logprobs"][:, 1:] = torch.where(loss_mask[:, 1:].bool(), behav[:, :-1], 0.0)
    rollout = actor.compute_advantages(rollout)
    assert ROUTED_EXPERTS not in rollout
    actor.ppo_update(rollout)
    routed = rollout[ROUTED_EXPERTS]
    calls = probe.take()
    n_record = len(e._split(batch).mbs) * len(e._routers.routers)
    out: dict[str, Any] = {"ppo_routed": routed, "ppo_train_used": [], "ppo_train_expected": []}
    used = calls[n_record:]  # the recording forward's router calls come first
    for rows in split_minibatches({"attention_mask": batch["attention_mask"], "idx": torch.arange(8)}, 2, 4):
        sub = {k: v[rows["idx"]] for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        plan = e._split(sub)
        n = len(plan.mbs) * len(e._routers.routers)
        out["ppo_train_used"].append(used[:n])
        out["ppo_train_expected"].append(packed_routing(sub, routed[rows["idx"]], plan))
        used = used[n:]
    # ReinforceActor (one step) records them the same way before its step
    from tandemrl.algorithms.reinforce import ReinforceActor

    fresh = {
        k: v for k, v in rollout.items() if k in ("input_ids", "attention_mask", "loss_mask", "rewards", "logprobs")
    }
    ReinforceActor(PPOActorConfig(engine=e.config), e).train_reinforce(fresh)
    out["reinforce_recorded"] = ROUTED_EXPERTS in fresh
    e.destroy()
    return out


def main() -> None:
    init_default_process_group()
    e = build(ARGS.model, ARGS.lr)
    probe = RoutingProbe(e)
    if ARGS.router_only:
        freeze_all_but_routers(e)
    batch = make_batch(ARGS.seed, n=8, max_len=48)
    action = torch.zeros_like(batch["loss_mask"])
    action[:, :-1] = batch["loss_mask"][:, 1:]  # logp[:, t] scores token t + 1: the sampled tokens' positions
    adv = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(ARGS.seed))
    out: dict[str, Any] = {}

    behav = e.forward(batch, post_hook=logp_of)  # free routing at the behaviour weights: records it
    routed = batch[ROUTED_EXPERTS].clone()
    out["record_used"], out["routed"] = probe.take(), routed
    plan = e._split(batch)
    out["packed"] = packed_routing(batch, routed, plan)
    again = e.forward(batch, post_hook=logp_of)  # same weights, replayed
    out["replay_same_weights"] = (again - behav).abs().max().item()
    out["replay_used_before"] = probe.take()

    train = {**batch, "action_mask": action, "advantages": adv}
    for step in range(STEPS):
        e.train_batch(train, pg_loss, lambda mb: int(mb["action_mask"].sum()))
        if step == 0:
            out["replay_used_train"] = probe.take()
    probe.take()
    replayed = e.forward(batch, post_hook=logp_of)
    out["replay_used_after"] = probe.take()
    free_batch = {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}
    free = e.forward(free_batch, post_hook=logp_of)  # free routing at the updated weights (recorded anew)
    out["free_routed"] = free_batch[ROUTED_EXPERTS]
    sel = action.bool()
    out["gap_replay"] = (replayed - behav)[sel].abs().mean().item()
    out["gap_free"] = (free - behav)[sel].abs().mean().item()
    out["mask"] = batch["attention_mask"]
    out["moe_layers"] = sorted(e._routers.routers)
    try:
        e.train_batch({k: v for k, v in train.items() if k != ROUTED_EXPERTS}, pg_loss, lambda mb: 1)
        out["train_without_routing"] = "no error"
    except ValueError as err:
        out["train_without_routing"] = str(err)
    e.destroy()
    out.update(ppo_section(ARGS.model, {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}, behav))
    try:
        build(ARGS.dense, alloc=f"megatron:d{dist.get_world_size()}")  # a dense model has no expert split
        out["dense_error"] = "no error"
    except ValueError as err:
        out["dense_error"] = str(err)
    if dist.get_world_size() == 2:
        try:
            build(ARGS.model, alloc="megatron:t2")
            out["tp_error"] = "no error"
        except ValueError as err:
            out["tp_error"] = str(err)
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(ARGS.out, "replay.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="tiny MoE model dir")
    p.add_argument("--dense", required=True, help="a dense model dir (router_replay must refuse it)")
    p.add_argument("--seed", type=int, default=400)
    p.add_argument("--alloc", default="megatron:d1", help="e.g. megatron:d2e2 under 2 torchrun ranks")
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--router-only", type=int, default=1)
    p.add_argument("--out", required=True)
    ARGS = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    main()
    destroy_process_groups()
