"""Draw a run's curves from its stats.jsonl: reward, greedy accuracy (periodic eval, and the held-out
score before and after from ``heldout_{before,after}.json`` beside it), truncation rate, share of groups
with a non-zero advantage, response length, KL and mismatch."""

from __future__ import annotations

import json
import os
import re

from tandemrl.utils.files import names_file

# One panel per entry: (title, [(legend label, regex on the stat key)]); the first key matching
# a pattern supplies that line, so the same panels fit PPO, GRPO, REINFORCE and their scopes.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("train (mean)", r"^rollout/reward$"), ("train (shaped)", r"/shaped_reward/avg$")]),
    ("greedy accuracy", [("eval", r"^eval-rollout/accuracy$")]),  # + held-out points (HELDOUT_PANEL)
    ("truncation rate (samples at max_new_tokens)", [("train", r"^rollout/truncated$")]),
    ("groups with a non-zero advantage (share)", [("train", r"/groups_with_signal$")]),
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


HELDOUT_PANEL = "greedy accuracy"
HELDOUT_TAGS = ("before", "after")

# A panel's line: (legend label, (stat key or file, steps, values, (low, high) per point or None)).
Line = tuple[str, tuple[str, list[int], list[float], list[tuple[float, float]] | None]]


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


def read_heldout(log_dir: str) -> tuple[str, list[int], list[float], list[tuple[float, float]]] | None:
    """The held-out scores in ``log_dir`` (heldout_before.json, heldout_after.json) as (label, steps, accuracy,
    95% interval): the step is the weight version scored (0 before training, N after N steps); None if neither."""
    steps, values, intervals, n = [], [], [], 0
    for tag in HELDOUT_TAGS:
        path = os.path.join(log_dir, f"heldout_{tag}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            item = json.load(f)
        steps.append(int(item["version"]))
        values.append(float(item["accuracy"]))
        intervals.append((float(item["interval_low"]), float(item["interval_high"])))
        n = int(item["n"])
    if not steps:
        return None
    return f"held-out, {n} questions (95% interval)", steps, values, intervals


def curve_panels(jsonl_path: str) -> list[tuple[str, list[Line]]]:
    """(title, lines) of every panel of :data:`PANELS` with data in ``jsonl_path`` (and the held-out files)."""
    rows = read_stats(jsonl_path)
    heldout = read_heldout(os.path.dirname(os.path.abspath(jsonl_path)))
    panels: list[tuple[str, list[Line]]] = []
    for title, lines in PANELS:
        found: list[Line] = []
        for label, pattern in lines:
            if (series := _series(rows, pattern)) is not None:
                key, steps, values = series
                found.append((f"{label}: {key}", (key, steps, values, None)))
        if title == HELDOUT_PANEL and heldout is not None:
            label, steps, values, intervals = heldout
            found.append((label, ("heldout_{before,after}.json", steps, values, intervals)))
        if found:
            panels.append((title, found))
    return panels


def plot_curves(jsonl_path: str, out_path: str | None = None) -> str | None:
    """Write a PNG of :func:`curve_panels` next to ``jsonl_path`` (or at ``out_path``); None if nothing to draw."""
    panels = curve_panels(jsonl_path)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, found) in zip(axes[:, 0], panels, strict=True):
        for label, (_, steps, values, intervals) in found:
            if intervals is None:
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                continue
            pairs = list(zip(values, intervals, strict=True))
            err = [[v - lo for v, (lo, _) in pairs], [hi - v for v, (_, hi) in pairs]]
            ax.errorbar(steps, values, yerr=err, fmt="s-", markersize=5, capsize=4, label=label)
            for x, v in zip(steps, values, strict=True):
                ax.annotate(f"{v:.1%}", (x, v), textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = out_path or os.path.join(os.path.dirname(os.path.abspath(jsonl_path)), "curves.png")
    try:
        with names_file(out):
            fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
