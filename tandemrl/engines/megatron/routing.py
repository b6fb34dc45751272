"""MoE routing replay (R3) on the Megatron engine: the pure index logic and the patch point on megatron's routers.

A sample's routing is ``routed_experts`` ([B, L, n_layers, k] padded, [T, n_layers, k] packed): for each
token, the ``k`` experts each decoder layer routed it to when it was the model's input (layer = HF layer
index; dense layers and padding hold -1). The patch point is megatron-core's own ``RouterReplay`` (one per
``TopKRouter`` when ``moe_enable_routing_replay`` is set): ``RouterSwitch`` puts every router of one model
in RECORD mode (free routing, indices kept) or REPLAY_FORWARD mode (the given indices; the router's
probabilities are still computed from its current logits at those experts, so gradients reach the router).
Only this module touches megatron's replay state, and only the routers of its own model (megatron's global
instance list is shared by every model of the process).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tandemrl.api.types import ROUTED_EXPERTS

NOT_ROUTED = -1  # dense layers, padding


def indices_to_routing_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] expert indices -> [T, E] bool routing map (megatron's layout). Rejects out-of-range or
    repeated experts in a row."""
    if indices.dim() != 2:
        raise ValueError(f"routing indices must be [T, k], got shape {tuple(indices.shape)}")
    idx = indices.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
        raise ValueError(f"routing indices must lie in [0, {num_experts}), got {int(idx.min())}..{int(idx.max())}")
    routing_map = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool, device=idx.device)
    routing_map.scatter_(1, idx, True)
    if bool((routing_map.sum(1) != idx.shape[1]).any()):
        raise ValueError("routing indices repeat an expert within a token")
    return routing_map


def routing_map_to_indices(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] bool routing map -> [T, k] expert indices in ascending order (a canonical form: the
    router's top-k order is by score, which a map does not keep). Every row must select ``k`` experts."""
    if routing_map.dim() != 2:
        raise ValueError(f"routing map must be [T, E], got shape {tuple(routing_map.shape)}")
    rm = routing_map.bool()
    counts = rm.sum(1)
    if bool((counts != k).any()):
        raise ValueError(f"every token must route to {k} experts, got counts {sorted(set(counts.tolist()))}")
    experts = torch.arange(rm.shape[1], device=rm.device).expand_as(rm)
    return experts[rm].reshape(-1, k)


def canonical(indices: torch.Tensor) -> torch.Tensor:
    """Sort each token's expert indices (the last dim): equal routings compare equal whatever the order."""
    return indices.sort(dim=-1).values


def assemble_layers(per_layer: dict[int, torch.Tensor], n_layers: int, k: int) -> torch.Tensor:
    """{HF layer index: [T, k]} -> [T, n_layers, k] int64, ``NOT_ROUTED`` at the layers not given."""
    if not per_layer:
        raise ValueError("no MoE layer recorded a routing")
    t = next(iter(per_layer.values())).shape[0]
    out = torch.full((t, n_layers, k), NOT_ROUTED, dtype=torch.long)
    for layer, idx in per_layer.items():
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} outside the model's {n_layers} layers")
        if tuple(idx.shape) != (t, k):
            raise ValueError(f"layer {layer}: recorded routing of shape {tuple(idx.shape)}, expected {(t, k)}")
        out[:, layer] = idx.detach().to("cpu", torch.long)
    return out


def layer_targets(routed: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """One layer's [T, k] indices to replay from a packed [T, n_layers, k] routing, checked: every token
    has a recorded routing for this layer, within [0, num_experts)."""
    if routed.dim() != 3 or not 0 <= layer < routed.shape[1]:
        raise ValueError(
            f"{ROUTED_EXPERTS}: expected [T, n_layers, k] covering layer {layer}, got {tuple(routed.shape)}"
        )
    idx = routed[:, layer].long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
        raise ValueError(
            f"{ROUTED_EXPERTS}: layer {layer} has tokens without a recorded routing (or experts outside "
            f"[0, {num_experts})): was it recorded on this model?"
        )
    return idx


class RouterSwitch:
    """RECORD / REPLAY_FORWARD of megatron's ``RouterReplay`` on the routers of one model, per micro-batch."""

    def __init__(self, model: torch.nn.Module, n_layers: int, num_experts: int, k: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers: dict[int, Any] = {}  # HF layer index -> TopKRouter
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ValueError("router_replay: the model was built without moe_enable_routing_replay")
                self.routers[int(module.layer_number) - 1] = module  # megatron numbers layers from 1
        if not self.routers:
            raise ValueError("router_replay: the model has no MoE router")
        self.n_layers, self.num_experts, self.k = n_layers, num_experts, k

    @contextmanager
    def micro_batch(self, routed: torch.Tensor | None, recorded: list[torch.Tensor] | None) -> Iterator[None]:
        """Replay ``routed`` ([T, n_layers, k] packed) in this forward, or (None) route freely and append the
        routing used ([T, n_layers, k], CPU) to ``recorded`` when a list is given."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self.routers.items():
            replay = router.router_replay
            if routed is not None:
                replay.set_target_indices(layer_targets(routed, layer, self.num_experts))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            if routed is None and recorded is not None:
                got = {layer: r.router_replay.get_recorded_indices() for layer, r in self.routers.items()}
                recorded.append(assemble_layers(got, self.n_layers, self.k))
        finally:
            for router in self.routers.values():  # backward needs no indices: no activation recompute here
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def release(self) -> None:
        """Drop this model's entries from megatron's process-global instance list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r.router_replay) for r in self.routers.values()}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]
        self.routers = {}
