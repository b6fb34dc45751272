"""Advantage estimators: GAE and one configurable baseline/normalizer (GRPO, Dr.GRPO, RLOO, REINFORCE++, ReMax).

Pure tensor functions. Sequences of a group (samples of one prompt) are consecutive rows.
Cross-rank statistics (batch level under data parallelism) are summed through an optional
``all_reduce`` callable, so this module never touches ``torch.distributed`` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandemrl.algorithms.layout import packed_to_padded, padded_to_packed

LEVELS = ("batch", "group", "none")
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the masked (action) positions of each sequence.

    ``delta_t = r_t + gamma * V_next(t) - V_t`` and ``A_t = delta_t + gamma * lam * A_next(t)``,
    where next(t) is the next masked position of the same sequence (unmasked positions such
    as tool outputs are skipped) and the step after the last one is terminal (V = A = 0).
    Returns ``(advantages, returns = advantages + values)``, both 0 where ``mask`` is False.
    Inputs are padded [B, L] rows, or packed 1-D tensors with ``cu_seqlens``. Rewards at
    unmasked positions are ignored.
    """
    if cu_seqlens is not None:
        r, v, m = (packed_to_padded(t, cu_seqlens) for t in (rewards.float(), values.float(), mask.bool()))
        adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
        return padded_to_packed(adv, cu_seqlens), padded_to_packed(ret, cu_seqlens)
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must share one padded [B, L] shape"
        )
    r, v, m = rewards.float(), values.float(), mask.bool()
    adv = torch.zeros_like(r)
    next_adv = torch.zeros_like(r[:, 0])
    next_value = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        here = m[:, t]
        adv[:, t] = torch.where(here, a, 0.0)
        next_adv = torch.where(here, a, next_adv)
        next_value = torch.where(here, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def _pool(row_sums: torch.Tensor, level: str, group_size: int, all_reduce: AllReduce | None) -> torch.Tensor:
    """Per-row totals over the row's pool (its group, or the whole batch on all ranks)."""
    if level == "group":
        return row_sums.view(-1, group_size, *row_sums.shape[1:]).sum(1).repeat_interleave(group_size, dim=0)
    total = row_sums.sum(0)
    if all_reduce is not None:
        total = all_reduce(total.clone())
    return total.expand_as(row_sums)


def normalization_stats(
    x: torch.Tensor,
    mask: torch.Tensor,
    group_size: int = 1,
    mean_level: str = "group",
    std_level: str = "group",
    leave_one_out: bool = False,
    unbiased: bool = True,
    eps: float = 1e-5,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row baseline and scale [B] such that the normalized value is ``(x - baseline) / scale``.

    Statistics are over the masked elements of ``x`` ([B] or [B, L]) pooled per level:
    ``group`` = the ``group_size`` consecutive rows of the row's group, ``batch`` = all rows
    (summed over ranks by ``all_reduce``), ``none`` = baseline 0 / scale 1.

    * baseline = pooled mean; with ``leave_one_out`` the mean of the pool *without the row's
      own elements* (RLOO: ``r_i - mean_{j != i} r_j``); a row whose pool holds nothing else
      (one valid sample in its group) gets its own mean, i.e. advantage 0.
    * scale = pooled std (around the std level's own mean, ``n - 1`` in the denominator when
      ``unbiased``) + ``eps``.
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"normalization: {name} must be one of {LEVELS}, got '{level}'")
    if mask.shape != x.shape:
        raise ValueError(f"normalization: mask shape {tuple(mask.shape)} differs from x shape {tuple(x.shape)}")
    bsz = x.shape[0]
    if "group" in (mean_level, std_level) and (group_size < 1 or bsz % group_size != 0):
        raise ValueError(f"normalization: batch of {bsz} rows is not a whole number of groups of {group_size}")
    m = mask.bool().reshape(bsz, -1)
    xf = torch.where(m, x.float().reshape(bsz, -1), 0.0)
    row = torch.stack([xf.sum(1), m.sum(1).to(xf.dtype)], dim=1)  # [B, 2]: sum, count

    baseline = torch.zeros(bsz, dtype=xf.dtype, device=x.device)
    if mean_level != "none":
        pooled = _pool(row, mean_level, group_size, all_reduce)
        if leave_one_out:
            pooled = pooled - row
            # Nothing else in the pool (the group's other samples were all masked out): the row's
            # own mean, so its advantage is 0 rather than the raw reward against a baseline of 0.
            pooled = torch.where(pooled[:, 1:] > 0, pooled, row)
        baseline = pooled[:, 0] / pooled[:, 1].clamp(min=1)

    scale = torch.ones(bsz, dtype=xf.dtype, device=x.device)
    if std_level != "none":
        pooled = _pool(row, std_level, group_size, all_reduce)
        mean = pooled[:, 0] / pooled[:, 1].clamp(min=1)
        sq = torch.where(m, (xf - mean[:, None]) ** 2, 0.0).sum(1)
        sq_pooled = _pool(sq, std_level, group_size, all_reduce)
        dof = pooled[:, 1] - 1 if unbiased else pooled[:, 1]
        scale = (sq_pooled / dof.clamp(min=1)).sqrt() + eps
    return baseline, scale


def groups_with_signal(advantages: torch.Tensor, action: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group of ``group_size`` consecutive rows: True if any action token has a non-zero advantage.

    A GRPO group whose samples all earned the same reward normalizes to advantage 0 everywhere
    and moves nothing; the share of True is the share of groups that carried a gradient signal.
    A batch that is not a whole number of groups is taken row by row.
    """
    rows = ((advantages != 0) & action.bool()).reshape(advantages.shape[0], -1).any(dim=1)
    g = group_size if group_size >= 1 and rows.numel() % group_size == 0 else 1
    return rows.view(-1, g).any(dim=1)


def normalize_advantages(x: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``(x - baseline) / scale`` with the statistics of :func:`normalization_stats` (kwargs); 0 off-mask."""
    baseline, scale = normalization_stats(x, mask, **kwargs)  # type: ignore[arg-type]
    shape = (-1,) + (1,) * (x.dim() - 1)
    return torch.where(mask.bool(), (x.float() - baseline.view(shape)) / scale.view(shape), 0.0)


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, use_std: bool = True, unbiased: bool = True, eps: float = 1e-5
) -> torch.Tensor:
    """GRPO ``(r - mean_g) / (std_g + eps)``; Dr.GRPO (``use_std=False``) ``r - mean_g``. Rewards [B]."""
    mask = torch.ones_like(rewards, dtype=torch.bool)
    std = "group" if use_std else "none"
    return normalize_advantages(
        rewards, mask, group_size=group_size, mean_level="group", std_level=std, unbiased=unbiased, eps=eps
    )


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i in group} r_j`` for rewards [B]."""
    mask = torch.ones_like(rewards, dtype=torch.bool)
    return normalize_advantages(
        rewards, mask, group_size=group_size, mean_level="group", std_level="none", leave_one_out=True
    )


def batch_normalized_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    eps: float = 1e-5,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """REINFORCE++: whiten token advantages with the mean/std over all masked tokens of the batch."""
    return normalize_advantages(
        advantages, mask, mean_level="batch", std_level="batch", unbiased=unbiased, eps=eps, all_reduce=all_reduce
    )


def remax_advantages(sample_rewards: torch.Tensor, greedy_rewards: torch.Tensor) -> torch.Tensor:
    """ReMax: the greedy completion's reward is the baseline, ``r(sample) - r(greedy)``."""
    if sample_rewards.shape != greedy_rewards.shape:
        raise ValueError(
            f"remax_advantages: sample rewards {tuple(sample_rewards.shape)} vs greedy {tuple(greedy_rewards.shape)}"
        )
    return sample_rewards.float() - greedy_rewards.float()
