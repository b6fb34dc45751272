"""End-to-end GRPO throughput: asynchronous (staleness 1 and 2) vs synchronous rollout.

Runs the same GSM8K GRPO job (tiny model, one vLLM server, FSDP trainer) through the
local launcher three times and compares the samples/s each run prints (measured over the
training loop, excluding server start-up). A benchmark: it prints figures, asserts nothing.

``--pause-modes`` runs the asynchronous job (staleness 1) twice instead, with
``rollout.pause_mode=abort`` and ``keep``, and also prints the tokens resubmitted after
updates (``rollout/resubmitted_tokens``, summed over the steps) and the mean share of
generated tokens in samples spanning two weight versions (``multi_version_tokens``).

    python bench/async_vs_sync.py [--steps 12] [--data ../shared/data/gsm8k] [extra overrides...]
    python bench/async_vs_sync.py --pause-modes [--steps 12] [extra overrides...]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THROUGHPUT = re.compile(r"throughput ([0-9.]+) samples/s, ([0-9.]+) generated tokens/s")

VARIANTS = {
    "sync": ["async_training=false"],
    "async k=1": ["async_training=true", "rollout.max_head_offpolicyness=1"],
    "async k=2": ["async_training=true", "rollout.max_head_offpolicyness=2"],
}
PAUSE_VARIANTS = {
    f"{mode:5s} k=1": ["async_training=true", "rollout.max_head_offpolicyness=1", f"rollout.pause_mode={mode}"]
    for mode in ("abort", "keep")
}


def trial_name(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def interruption_figures(fileroot: str, name: str) -> tuple[float, float]:
    """(resubmitted tokens summed over the steps, mean multi_version_tokens) from the run's stats.jsonl."""
    rows = []
    for path in Path(fileroot, "logs").glob(f"*/{trial_name(name)}/stats.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    resubmitted = sum(r.get("rollout/resubmitted_tokens", 0.0) for r in rows)
    multi = [v for r in rows for k, v in r.items() if "multi_version_tokens" in k]
    return resubmitted, sum(multi) / max(1, len(multi))


def run(name: str, overrides: list[str], fileroot: str) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/gsm8k_grpo.py"]
    cmd += [
        "--config",
        "examples/gsm8k_grpo.yaml",
        f"cluster.fileroot={fileroot}",
        f"trial_name={trial_name(name)}",
    ]
    cmd += overrides
    env = {**os.environ, "WANDB_SILENT": "true"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    match = THROUGHPUT.search(out.stdout)
    if out.returncode != 0 or match is None:
        tail = "\n".join(out.stdout.splitlines()[-20:])
        raise SystemExit(f"{name}: run failed (exit {out.returncode})\n{tail}")
    return float(match.group(1)), float(match.group(2))


def main() -> None:
    from tandemrl.utils.cli import ArgumentParser

    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "gsm8k"))
    p.add_argument("--pause-modes", action="store_true", help="Compare rollout.pause_mode abort vs keep (async k=1).")
    args, extra = p.parse_known_args()
    common = [
        f"train_dataset.path={args.data}",
        f"total_train_steps={args.steps}",
        "evaluator.freq_steps=100000",
        "saver.freq_steps=100000",
        *extra,
    ]
    if args.pause_modes:
        compare_pause_modes(common)
        return
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in VARIANTS.items():
            results[name] = run(name, overrides + common, root)
            print(f"{name:10s} {results[name][0]:7.2f} samples/s {results[name][1]:8.0f} gen tokens/s", flush=True)
    base = results["sync"][0]
    for name in ("async k=1", "async k=2"):
        print(f"{name} / sync: {results[name][0] / base:.2f}x samples/s")


def compare_pause_modes(common: list[str]) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in PAUSE_VARIANTS.items():
            results[name] = run(name, overrides + common, root)
            resubmitted, multi = interruption_figures(root, name)
            print(
                f"{name} {results[name][0]:7.2f} samples/s {results[name][1]:8.0f} gen tokens/s "
                f"{resubmitted:8.0f} resubmitted tokens, multi_version_tokens {multi:.3f}",
                flush=True,
            )
    abort, keep = (results[n][0] for n in PAUSE_VARIANTS)
    print(f"keep / abort: {keep / abort:.2f}x samples/s")


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("async_vs_sync"):
        main()
