"""Critic loss: squared error to the returns, optionally clipped around the old values."""

from __future__ import annotations

import torch

from tandemrl.algorithms.aggregation import aggregate_loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    eps_clip_value: float | None = None,
    agg_mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``L = 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2)`` aggregated over ``mask``.

    Without ``eps_clip_value`` it is ``0.5 * (v - R)^2``. Stats (detached, per token):
    ``clip_mask`` (the clipped error is the larger one), ``error`` (``v - R``) and ``mask``.
    """
    m = mask.bool()
    v = values.float()
    ret = torch.where(m, returns.float(), 0.0)
    err = (v - ret) ** 2
    clip_mask = torch.zeros_like(m)
    if eps_clip_value is not None:
        old = old_values.float()
        clipped = old + (v - old).clamp(-eps_clip_value, eps_clip_value)
        err_clipped = (clipped - ret) ** 2
        clip_mask = (err_clipped > err) & m
        err = torch.maximum(err, err_clipped)
    loss = aggregate_loss(0.5 * err, m, agg_mode, cu_seqlens)
    return loss, {"clip_mask": clip_mask, "error": torch.where(m, v - ret, 0.0).detach(), "mask": m}
