"""The per-step pipeline metrics that compare a synchronous and an asynchronous run 1:1 (docs/metrics.md).

Every RL step logs these keys, sync or async, to every sink (console, tensorboard, wandb, stats.jsonl):

* ``pipeline/trainer_idle``: share of the step the trainer waited for its batch (``timeperf/rollout_wait``);
* ``pipeline/server_idle``: share of the step with no generate request of this rank in flight;
* ``pipeline/weight_sync``: share of the step spent pushing weights to the servers;
* ``pipeline/staleness/avg`` and ``/max``: versions each trained token's sample lags the trainer,
  a sample counted at its oldest token's version and weighted by its tokens;
* ``<stats_name>/in_flight`` (the executor) and ``<stats_name>/env_wait`` (per episode): see
  ``tandemrl.rollout.executor``.

Shares are of ``timeperf/step`` and averaged over ranks like the phases of :mod:`time_split`.
"""

from __future__ import annotations

import torch

from tandemrl.trainers.time_split import SERVER_BUSY, STEP, add_step_timings
from tandemrl.utils import stats_tracker

_SHARES = {"trainer_idle": "rollout wait (trainer idle)", "weight_sync": "weight sync"}


def pipeline_shares(stats: dict[str, float], n_ranks: int) -> dict[str, float]:
    """``pipeline/trainer_idle``, ``/server_idle``, ``/weight_sync`` of one step's exported stats (0 when a
    phase did not run; the server share only when the rollout client reported its busy time)."""
    totals: dict[str, float] = {}
    add_step_timings(totals, stats, n_ranks)
    step = totals.get(STEP, 0.0)
    if step <= 0:
        return {}
    out = {f"pipeline/{key}": min(1.0, totals.get(label, 0.0) / step) for key, label in _SHARES.items()}
    if SERVER_BUSY in totals:
        out["pipeline/server_idle"] = max(0.0, 1.0 - totals[SERVER_BUSY] / step)
    return out


def oldest_version_lag(versions: torch.Tensor, loss_mask: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[B, L] float: on each trained token, how many versions the oldest token of its row lags
    ``trainer_version`` (0 off the mask)."""
    mask = loss_mask.bool()
    big = torch.iinfo(torch.long).max
    oldest = versions.long().masked_fill(~mask, big).min(dim=1).values
    lag = (trainer_version - oldest).clamp(min=0).to(torch.float32)
    return torch.where(mask, lag[:, None].expand_as(mask), torch.zeros((), dtype=torch.float32))


def record_staleness(versions: torch.Tensor, loss_mask: torch.Tensor, trainer_version: int) -> None:
    """Record ``pipeline/staleness`` (token-weighted, reduced exactly over ranks at export)."""
    mask = loss_mask.bool()
    with stats_tracker.scope("pipeline"):
        stats_tracker.denominator(trained_tokens=mask)
        stats_tracker.stat("trained_tokens", staleness=oldest_version_lag(versions, loss_mask, trainer_version))
