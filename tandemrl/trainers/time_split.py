"""Where a run's wall time went: totals of the ``timeperf/`` stats per phase, and the closing one-line split.

Phases are matched by the last part of a timing key, whatever its scope (``timeperf/rollout_wait``,
``timeperf/actor/ppo_actor/update/fwd_bwd``, ``timeperf/critic/ppo_critic/fwd_bwd`` ...). Shares are
of ``timeperf/step`` (the whole step), averaged over ranks like the phases; timings not named here
(``train_step``) contain phases and are not counted again.

The servers' side: ``server_busy`` (the rollout controller's ``<stats_name>/timeperf/server_busy``,
seconds with a generate request in flight) overlaps the trainer's phases when rollout is
asynchronous, so it is not a phase; the line ends with the servers' idle share of the steps' time.
"""

from __future__ import annotations

# (label in the summary line, the timing names it adds up), in the order a step runs them.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rollout wait (trainer idle)", ("rollout_wait",)),
    ("recompute", ("recompute_logp",)),
    ("ref fwd", ("ref_logp",)),
    ("critic fwd", ("compute_values",)),
    ("fwd+bwd", ("fwd_bwd",)),
    ("optimizer", ("optimizer_step",)),
    ("weight sync", ("update_weights",)),
    ("save/eval", ("save", "eval", "recover")),
)
STEP = "step"  # the whole step; the denominator of the shares
SERVER_BUSY = "server_busy"  # not a phase of the trainer: see the module docstring
_LABEL = {name: label for label, names in PHASES for name in names} | {STEP: STEP, SERVER_BUSY: SERVER_BUSY}
_PREFIX = "timeperf/"
_COUNT = "__count"


def add_step_timings(totals: dict[str, float], stats: dict[str, float], n_ranks: int) -> None:
    """Add one step's exported timings to ``totals`` (seconds per phase label and ``STEP``, averaged over ranks).

    An exported timing is the mean over its calls on ``n_ranks`` ranks, with ``key__count`` calls.
    """
    for key, mean in stats.items():
        if not (key.startswith(_PREFIX) or f"/{_PREFIX}" in key) or key.endswith(_COUNT):
            continue
        label = _LABEL.get(key.rsplit("/", 1)[-1])
        if label is not None:
            calls = stats.get(key + _COUNT, float(n_ranks))
            totals[label] = totals.get(label, 0.0) + mean * calls / n_ranks


def format_time_split(totals: dict[str, float]) -> str:
    """``time split: rollout wait (trainer idle) 12% | ... | other 3%; server idle 70%`` of the steps' time."""
    phases = sum(v for k, v in totals.items() if k not in (STEP, SERVER_BUSY))
    seconds = max(totals.get(STEP, phases), 1e-9)
    parts = [f"{label} {100 * totals[label] / seconds:.0f}%" for label, _ in PHASES if label in totals]
    other = max(0.0, seconds - phases)
    parts.append(f"other {100 * other / seconds:.0f}%")
    line = "time split: " + " | ".join(parts)
    if SERVER_BUSY in totals:
        idle = max(0.0, seconds - totals[SERVER_BUSY])
        line += f"; server idle {100 * idle / seconds:.0f}%"
    return line
