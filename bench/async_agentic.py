"""Async vs sync where async RL earns its keep: agents waiting on a tool, and heavy-tailed generation lengths.

Back to back in one sitting, through the local launcher with a real vLLM server and the FSDP trainer (tiny
model), each workload runs the two synchronous placements (colocated ``vllm:d1|fsdp:d1`` and disaggregated
``vllm:d1+fsdp:d1``) and asynchronous training at staleness 1, 2 and 4 (disaggregated), and prints per run:
samples/s, the ratio to the best synchronous run, the trainer's and the servers' idle shares (the run's
``time split`` line) and the token-weighted staleness per step (``pipeline/staleness``, docs/metrics.md).

* ``agentic``: ``examples/gsm8k_agent.py`` with :func:`agentic_env.tool_agent`: one forced calculator call per
  sample, answered by :class:`agentic_env.ToolService` (a real HTTP service in this process) after a latency
  drawn from ``--latency`` (lognormal, median 0.5 s, p99 5 s by default), then the model's answer.
* ``long-tail``: ``bench/longtail_grpo.py``: each request's ``max_new_tokens`` drawn from Pareto(``--tail``).
* ``openenv``: ``examples/openenv_grpo.py`` on :mod:`openenv_slow_env` (an OpenEnv server the launcher starts,
  with the python of ``--openenv-python``): retry_arithmetic, two replies per episode at most, every environment
  step answered after a latency drawn from ``--latency`` (the same distribution as the tool's).

It ends with one line per workload, ``agentic: async/sync 2.13 (best async ..., best sync ...)``.
A benchmark: it prints figures and asserts nothing.

    python bench/async_agentic.py [--steps 10] [--workloads agentic,long-tail,openenv] [--data ../shared/data/gsm8k]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from agentic_env import TOOL_URL_ENV, Latency, ToolService  # noqa: E402

THROUGHPUT = re.compile(r"throughput ([0-9.]+) samples/s")
TRAINER_IDLE = re.compile(r"rollout wait \(trainer idle\) ([0-9]+)%")
SERVER_IDLE = re.compile(r"server idle ([0-9]+)%")
DISAGGREGATED = "allocation_mode=vllm:d1+fsdp:d1"
VARIANTS = {
    "sync colocated": ["allocation_mode=vllm:d1|fsdp:d1", "async_training=false"],
    "sync disaggregated": [DISAGGREGATED, "async_training=false"],
    **{
        f"async k={k}": [DISAGGREGATED, "async_training=true", f"rollout.max_head_offpolicyness={k}"] for k in (1, 2, 4)
    },
}


@dataclass
class Result:
    samples_per_s: float
    trainer_idle: float  # share of the loop, from the time split line
    server_idle: float
    staleness: list[float]  # pipeline/staleness/avg per step
    staleness_max: float


def workload_args(name: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """(script, overrides) of a workload."""
    if name == "agentic":
        return "examples/gsm8k_agent.py", [
            "--config",
            "examples/gsm8k_agent.yaml",
            "agent.agent=agentic_env:tool_agent",
            f"gconfig.max_new_tokens={args.agent_tokens}",
            f"train_dataset.path={args.data}",
        ]
    if name == "openenv":
        return "examples/openenv_grpo.py", [
            "--config",
            "examples/openenv_grpo.yaml",
            "openenv.app=openenv_slow_env:app",
            f"openenv.paths=[{REPO / 'bench'},{REPO / 'examples' / 'openenv_envs'}]",
            f"openenv.python={args.openenv_python}",
            "gconfig.max_new_tokens=16",
        ]
    return "bench/longtail_grpo.py", [
        "--config",
        "examples/gsm8k_grpo.yaml",
        f"gconfig.max_new_tokens={args.tail_cap}",
        f"train_dataset.path={args.data}",
    ]


def run(script: str, overrides: list[str], fileroot: str, trial: str, env: dict[str, str]) -> Result:
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", script, *overrides]
    cmd += [f"cluster.fileroot={fileroot}", f"trial_name={trial}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    found = [p.search(out.stdout) for p in (THROUGHPUT, TRAINER_IDLE, SERVER_IDLE)]
    if out.returncode != 0 or any(m is None for m in found):
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-25:])
        raise SystemExit(f"{trial}: run failed (exit {out.returncode})\n{tail}")
    rows = []
    for path in Path(fileroot, "logs").glob(f"*/{trial}/stats.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    staleness = [r["pipeline/staleness/avg"] for r in rows if "pipeline/staleness/avg" in r]
    worst = max((r.get("pipeline/staleness/max", 0.0) for r in rows), default=0.0)
    rate, trainer, server = (float(m.group(1)) for m in found)  # type: ignore[union-attr]
    return Result(rate, trainer / 100, server / 100, staleness, worst)


def show(name: str, r: Result, best_sync: float | None) -> None:
    ratio = f"{r.samples_per_s / best_sync:5.2f}x" if best_sync else "   -  "
    per_step = " ".join(f"{s:.1f}" for s in r.staleness)
    print(
        f"  {name:19s} {r.samples_per_s:7.2f} samples/s {ratio} best sync | trainer idle {100 * r.trainer_idle:3.0f}% "
        f"| server idle {100 * r.server_idle:3.0f}% | staleness per step [{per_step}] max {r.staleness_max:.0f}",
        flush=True,
    )


def bench_workload(name: str, args: argparse.Namespace, common: list[str], env: dict[str, str], root: str) -> str:
    script, overrides = workload_args(name, args)
    results: dict[str, Result] = {}
    print(f"{name}: {script} {' '.join(overrides + common)}", flush=True)
    for variant, extra in VARIANTS.items():
        if args.variants and variant not in args.variants.split(","):
            continue
        trial = f"{name}-{variant}".replace(" ", "_").replace("=", "")
        results[variant] = run(script, overrides + common + extra, root, trial, env)
        show(variant, results[variant], None)
    best_sync_name = max((v for v in results if v.startswith("sync")), key=lambda v: results[v].samples_per_s)
    best_async_name = max((v for v in results if v.startswith("async")), key=lambda v: results[v].samples_per_s)
    best_sync, best_async = results[best_sync_name], results[best_async_name]
    print(f"{name} against the best sync run ({best_sync_name}):", flush=True)
    for variant, r in results.items():
        show(variant, r, best_sync.samples_per_s)
    return (
        f"{name}: async/sync {best_async.samples_per_s / best_sync.samples_per_s:.2f} "
        f"(best async {best_async_name} {best_async.samples_per_s:.2f} samples/s, trainer idle "
        f"{100 * best_async.trainer_idle:.0f}%; best sync {best_sync_name} {best_sync.samples_per_s:.2f} samples/s)"
    )


def main() -> None:
    from tandemrl.utils.cli import ArgumentParser

    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workloads", default="agentic,long-tail")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "gsm8k"))
    p.add_argument("--batch-size", type=int, default=8, help="Prompts per step (train_dataset.batch_size).")
    p.add_argument("--latency", default="lognormal,0.5,5.0", help="Tool latency: lognormal,MEDIAN,P99 | fixed,S")
    p.add_argument("--seed", type=int, default=0, help="Seed of the tool latencies.")
    # The forced call alone takes 61-64 tokens of the tiny tokenizer under the regex: 64 cut most calls short
    # (no tool call parsed, the session split in two), as the first run of this script showed.
    p.add_argument("--agent-tokens", type=int, default=128, help="gconfig.max_new_tokens of the agentic runs.")
    p.add_argument("--tail", default="16,1.2", help="Long tail: Pareto minimum tokens and tail index alpha.")
    p.add_argument("--tail-cap", type=int, default=512, help="gconfig.max_new_tokens (the cap of the draws).")
    p.add_argument("--openenv-python", default=".venv-openenv/bin/python", help="openenv.python of the openenv runs.")
    p.add_argument("--variants", default="", help=f"Comma-separated subset of: {', '.join(VARIANTS)} (default all).")
    args, extra = p.parse_known_args()
    kind, *values = args.latency.split(",")
    latency = Latency(kind, *(float(v) for v in values), seed=args.seed)  # type: ignore[arg-type]
    common = [
        f"train_dataset.batch_size={args.batch_size}",
        f"total_train_steps={args.steps}",
        "evaluator.freq_steps=100000",
        "saver.freq_steps=100000",
        "heldout_eval.n=0",
        *extra,
    ]
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "bench"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": pythonpath, "TANDEMRL_BENCH_TAIL": args.tail}
    env.update(TANDEMRL_BENCH_ENV_LATENCY=args.latency, TANDEMRL_BENCH_ENV_SEED=str(args.seed))
    lines = []
    with tempfile.TemporaryDirectory() as root, ToolService(latency) as tools:
        env[TOOL_URL_ENV] = tools.url
        print(f"tool service {tools.url}: latency {latency.describe()}", flush=True)
        print(f"long tail: max_new_tokens ~ min({args.tail_cap}, ceil(Pareto(minimum, alpha = {args.tail})))")
        for name in args.workloads.split(","):
            lines.append(bench_workload(name, args, common, env, root))
        print(f"tool calls served: {tools.served}", flush=True)
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("async_agentic"):
        main()
