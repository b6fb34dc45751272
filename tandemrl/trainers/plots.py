"""Draw a run's curves (reward, eval accuracy, response length, KL and mismatch) from its stats.jsonl."""

from __future__ import annotations

import json
import os
import re

# One panel per entry: (title, [(legend label, regex on the stat key)]); the first key matching
# a pattern supplies that line, so the same panels fit PPO, GRPO, REINFORCE and their scopes.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("train (mean)", r"^rollout/reward$"), ("train (shaped)", r"/shaped_reward/avg$")]),
    ("greedy eval accuracy", [("eval", r"^eval-rollout/accuracy$")]),
    ("response length (tokens)", [("mean", r"/response_len/avg$"), ("max", r"/response_len/max$")]),
    (
        "KL and train/inference mismatch",
        [
            ("approx KL to old policy", r"/update/approx_kl/avg$"),
            ("KL(behaviour || trainer), k3", r"/offpolicy/kl_k3$"),
            ("KL reward to reference", r"/kl_rewards/avg$"),
        ],
    ),
]


def read_stats(path: str) -> dict[int, dict[str, float]]:
    """step -> stats from a stats.jsonl; a step logged twice (a resumed run) keeps its last line."""
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            rows[int(item.pop("step"))] = item
    return rows


def _series(rows: dict[int, dict[str, float]], pattern: str) -> tuple[str, list[int], list[float]] | None:
    regex = re.compile(pattern)
    keys = sorted({k for r in rows.values() for k in r if regex.search(k)})
    if not keys:
        return None
    key = keys[0]
    steps = [s for s in sorted(rows) if key in rows[s]]
    return key, steps, [rows[s][key] for s in steps]


def plot_curves(jsonl_path: str, out_path: str | None = None) -> str | None:
    """Write a PNG of :data:`PANELS` next to ``jsonl_path`` (or at ``out_path``); None if nothing to draw."""
    rows = read_stats(jsonl_path)
    panels = []
    for title, lines in PANELS:
        found = [(label, s) for label, pattern in lines if (s := _series(rows, pattern)) is not None]
        if found:
            panels.append((title, found))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, found) in zip(axes[:, 0], panels, strict=True):
        for label, (key, steps, values) in found:
            ax.plot(steps, values, marker="o", markersize=3, label=f"{label}: {key}")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = out_path or os.path.join(os.path.dirname(os.path.abspath(jsonl_path)), "curves.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
