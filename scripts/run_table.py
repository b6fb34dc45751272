"""Per-step learning signals of one or more RL runs, side by side, from their ``stats.jsonl``.

    python scripts/run_table.py runs/logs/gsm8k-grpo-smollm2/trial0 runs/logs/gsm8k-grpo-smollm2/overlong32

For each run directory (the trainer's log dir: ``stats.jsonl``, ``trainer.log``) it prints, per step,
the truncation rate (``rollout/truncated``: samples that hit ``max_new_tokens``), the task reward
(``rollout/reward``, before any shaping), the reward after shaping (``shaped_reward``: the overlong
penalty included), the mean response length and the share of groups with a non-zero advantage;
then first / last / mean of each, and the trainer's held-out line (before -> after, McNemar p).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# column name -> key suffix in stats.jsonl
COLUMNS = {
    "truncated": "rollout/truncated",
    "reward": "rollout/reward",
    "shaped": "ppo_actor/shaped_reward/avg",
    "length": "ppo_actor/response_len/avg",
    "signal": "ppo_actor/groups_with_signal",
}


def _value(row: dict[str, float], suffix: str) -> float | None:
    hits = [v for k, v in row.items() if k == suffix or k.endswith("/" + suffix)]
    return hits[0] if hits else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def table(run: Path) -> str:
    """The per-step table and the summary lines of one run directory."""
    rows = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines() if line.strip()]
    out = [f"## {run}", "| step | " + " | ".join(COLUMNS) + " |", "| --- " * (len(COLUMNS) + 1) + "|"]
    series: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for row in rows:
        vals = {c: _value(row, s) for c, s in COLUMNS.items()}
        for c, v in vals.items():
            if v is not None:
                series[c].append(v)
        out.append(f"| {row.get('step', '?')} | " + " | ".join(_fmt(v) for v in vals.values()) + " |")
    for c, vs in series.items():
        if vs:
            out.append(f"{c}: first {_fmt(vs[0])}, last {_fmt(vs[-1])}, mean {_fmt(statistics.fmean(vs))}")
    log = run / "trainer.log"
    if log.exists():
        out += [line for line in log.read_text().splitlines() if "held-out greedy accuracy on" in line]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python scripts/run_table.py RUN_LOG_DIR [RUN_LOG_DIR ...]", file=sys.stderr)
        return 2
    for arg in argv:
        run = Path(arg)
        if not (run / "stats.jsonl").exists():
            print(f"run_table: {run} has no stats.jsonl (give the run's log dir)", file=sys.stderr)
            return 2
        print(table(run), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
