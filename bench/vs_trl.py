"""tandemrl GRPO vs TRL's GRPOTrainer, back to back on the same model, prompts and lengths.

Both sides train the same model directory on the same GSM8K prompts (rows of train.jsonl whose
chat-templated prompt fits ``--max-prompt-len`` tokens, in file order, no shuffling), with the
same group size, completion length (exactly ``--new-tokens`` per sample: EOS is held back until
then on both sides), temperature, learning rate and step count. tandemrl runs through its real
launcher with the main job's config (``examples/gsm8k_grpo.yaml``); its rate is the run's own
summary line. TRL runs ``GRPOTrainer`` with plain HF ``generate`` (no vLLM) in a separate
virtualenv (``.venv-bench``, built from ``bench/requirements-trl.txt`` on first use); its time is
the trainer's own ``train_runtime``. Prints samples/s, completion tokens/s, s/step, the
tandemrl/TRL ratio and the load average. ``--repeats N`` runs the two sides interleaved N times each
(tandemrl, TRL, tandemrl, TRL, ...) and ends with the median samples/s per side and the median of the
per-pair ratios, with their min-max. A benchmark: it asserts nothing.

    python bench/vs_trl.py --model 25m
    python bench/vs_trl.py --model 25m --repeats 3
    python bench/vs_trl.py --model tiny --tandemrl-overrides "actor.engine.mixed_precision=bfloat16"
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "gsm8k"
REQUIREMENTS = REPO / "bench" / "requirements-trl.txt"
MAIN_JOB_CONFIG = "examples/gsm8k_grpo.yaml"
# make_tiny options per --model; "25m" is the ~25M-parameter Qwen2 of tests/integration/test_weight_sync.py.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "25m": {"hidden": 512, "layers": 8, "intermediate": 1536, "heads": 8, "kv_heads": 2},
}
SUMMARY = re.compile(
    r"done: (\d+) steps in \d+ s; .*throughput ([0-9.]+) samples/s, ([0-9.]+) generated tokens/s; logs in (\S+);"
)
RESULT_TAG = "VS_TRL_RESULT "
STAMP = ".vs-trl-deps"
# Keys that define the shared workload: set by the bench on both sides, never by the extra flags.
TANDEMRL_WORKLOAD_KEYS = (
    "total_train_steps",
    "train_dataset.path",
    "train_dataset.batch_size",
    "train_dataset.max_length",
    "train_dataset.shuffle",
    "gconfig.n_samples",
    "gconfig.max_new_tokens",
    "gconfig.min_new_tokens",
    "gconfig.temperature",
    "actor.group_size",
    "actor.engine.path",
    "actor.engine.optimizer.lr",
)
TRL_WORKLOAD_KEYS = (
    "max_steps",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "generation_kwargs",
    "temperature",
    "learning_rate",
    "shuffle_dataset",
    "output_dir",
)


@dataclass(frozen=True)
class Workload:
    """What both sides run: one step trains ``prompts`` x ``group_size`` samples of ``new_tokens`` tokens."""

    model_dir: str
    data: str
    prompts: int = 8
    group_size: int = 4
    new_tokens: int = 64
    max_prompt_len: int = 256
    temperature: float = 1.0
    lr: float = 1e-4
    steps: int = 10

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.group_size


@dataclass
class Result:
    """One side's figures; rates derive from the seconds per step."""

    name: str
    s_per_step: float
    samples_per_step: int
    new_tokens: int
    mean_completion_len: float

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.s_per_step

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.new_tokens


@dataclass(frozen=True)
class Summary:
    """The figures over repeated runs: per side the median samples/s and its min-max (``None`` for a side
    that did not run), the tandemrl/TRL ratio of each interleaved pair, and the median and min-max of those."""

    tandemrl_median: float | None
    tandemrl_range: tuple[float, float] | None
    trl_median: float | None
    trl_range: tuple[float, float] | None
    ratios: tuple[float, ...]
    ratio_median: float | None
    ratio_range: tuple[float, float] | None


def _median_range(values: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    return (statistics.median(values), (min(values), max(values))) if values else (None, None)


def summarize(tandemrl_rates: list[float], trl_rates: list[float]) -> Summary:
    """The ``Summary`` of samples/s over runs; run i of one side pairs with run i of the other.

    One side may be empty (``--only``): it has no figures and there are no ratios. Otherwise both sides
    need the same number of runs.
    """
    if not tandemrl_rates and not trl_rates:
        raise ValueError("summarize: no runs")
    if tandemrl_rates and trl_rates and len(tandemrl_rates) != len(trl_rates):
        raise ValueError(f"summarize: {len(tandemrl_rates)} tandemrl runs but {len(trl_rates)} TRL runs")
    ratios = [t / r for t, r in zip(tandemrl_rates, trl_rates, strict=True)] if tandemrl_rates and trl_rates else []
    t_median, t_range = _median_range(tandemrl_rates)
    r_median, r_range = _median_range(trl_rates)
    ratio_median, ratio_range = _median_range(ratios)
    return Summary(t_median, t_range, r_median, r_range, tuple(ratios), ratio_median, ratio_range)


# ----------------------------------------------------------------------------- the two configs


def _keys(overrides: list[str]) -> list[str]:
    keys = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"bench: override {item!r} is not key=value")
        keys.append(key.lstrip("+~"))
    return keys


def check_extra(overrides: list[str], workload_keys: tuple[str, ...], flag: str) -> None:
    """Refuse an extra override that would change the shared workload on one side only."""
    for key in _keys(overrides):
        if key in workload_keys:
            raise SystemExit(
                f"bench: {flag} may not set {key}: the bench sets it on both sides (use the bench's flags)"
            )


def tandemrl_overrides(w: Workload, fileroot: str, extra: list[str]) -> list[str]:
    """Config overrides on top of the main job's YAML: the workload, no eval/save (not even the final one), then ``extra``."""
    check_extra(extra, TANDEMRL_WORKLOAD_KEYS, "--tandemrl-overrides")
    return [
        f"train_dataset.path={w.data}",
        f"actor.engine.path={w.model_dir}",
        f"total_train_steps={w.steps}",
        f"train_dataset.batch_size={w.prompts}",
        f"train_dataset.max_length={w.max_prompt_len}",
        "train_dataset.shuffle=false",
        f"gconfig.n_samples={w.group_size}",
        f"actor.group_size={w.group_size}",
        f"gconfig.max_new_tokens={w.new_tokens}",
        f"gconfig.min_new_tokens={w.new_tokens}",
        f"gconfig.temperature={w.temperature}",
        f"actor.engine.optimizer.lr={w.lr}",
        "evaluator.freq_steps=100000",
        "saver.freq_steps=100000",
        # No final HF save: TRL runs with save_strategy="no" and its train_runtime excludes saving; the
        # save would land inside tandemrl's measured loop (its last step; 2-3 s on a 25 s tiny run).
        "saver.save_final=false",
        f"cluster.fileroot={fileroot}",
        *extra,
    ]


def tandemrl_command(w: Workload, fileroot: str, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "examples/gsm8k_grpo.py", "--config", MAIN_JOB_CONFIG]
    return cmd + tandemrl_overrides(w, fileroot, extra)


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def trl_args(w: Workload, output_dir: str, extra: list[str]) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments: the workload, fp32, no checkpointing/saving, then ``extra``.

    fp32 and no gradient checkpointing match tandemrl's defaults (TRL defaults to bf16 and
    checkpointing); ``extra`` (``key=json-or-text``) changes that.
    """
    check_extra(extra, TRL_WORKLOAD_KEYS, "--trl-args")
    args: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": w.steps,
        "per_device_train_batch_size": w.samples_per_step,
        "num_generations": w.group_size,
        "max_completion_length": w.new_tokens,
        "generation_kwargs": {"min_new_tokens": w.new_tokens},
        "temperature": w.temperature,
        "learning_rate": w.lr,
        "lr_scheduler_type": "constant",
        "shuffle_dataset": False,
        "bf16": False,
        "gradient_checkpointing": False,
        "use_vllm": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }
    for item in extra:
        key, _, value = item.partition("=")
        args[key] = _literal(value)
    return args


def tandemrl_config(w: Workload, fileroot: str, extra: list[str]) -> Any:
    """The GRPOConfig the launcher will run, loaded by tandemrl's own config loader."""
    from tandemrl.configs import GRPOConfig
    from tandemrl.trainers.entry import load_config

    argv = ["--config", str(REPO / MAIN_JOB_CONFIG), *tandemrl_overrides(w, fileroot, extra)]
    return load_config(argv, GRPOConfig)[0]


def prompt_rows(config: Any) -> list[dict[str, Any]]:
    """The prompts of tandemrl's first ``total_train_steps`` batches, from the trainer's own data code, in order."""
    from tandemrl.data.loader import create_dataloader, dataset_from_config
    from tandemrl.models.hf import load_hf_tokenizer, model_context_length

    data, path = config.train_dataset, config.actor.engine.path
    ds = dataset_from_config(data, load_hf_tokenizer(path), 0, 1, model_context_length(path))
    rows: list[dict[str, Any]] = []
    for step, batch in enumerate(create_dataloader(ds, data, 0, 1, seed=config.seed)):
        if step == config.total_train_steps:
            break
        rows += [{"id": row["id"], "prompt": row["messages"], "answer": row["answer"]} for row in batch]
    return rows


def model_dir(model: str, data: str) -> str:
    """The model directory of ``--model`` (built once and cached like ``tiny:qwen2``)."""
    from tandemrl.models.make_tiny import ensure_tiny_model
    from tandemrl.models.resolve import tiny_model_cache

    return ensure_tiny_model(tiny_model_cache(), "qwen2", corpus_path=data, **MODELS[model])


# ----------------------------------------------------------------------------- running each side


def child_env() -> dict[str, str]:
    """The environment of both runs: offline, quiet, each side's own thread counts, passive OpenMP waits.

    ``OMP_WAIT_POLICY=PASSIVE`` (unless already set) because on a loaded machine spinning OpenMP
    threads made HF ``generate`` with 2 threads ~20x slower here (0.5-1.4 s vs 22-26 s for 32x64 tokens).
    """
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(
        WANDB_SILENT="true",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_logged(cmd: list[str], log: Path, env: dict[str, str]) -> str:
    """Run ``cmd`` from the repo root with stdout+stderr to ``log``; its output, or exit naming the log."""
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    out = log.read_text(errors="replace")
    if rc != 0:
        tail = "\n".join(out.splitlines()[-15:])
        raise SystemExit(f"{tail}\nbench: {Path(cmd[1]).name if cmd[1] != '-m' else cmd[2]} exited {rc}; log {log}")
    return out


def parse_tandemrl(out: str, w: Workload) -> Result:
    match = SUMMARY.search(out)
    if match is None:
        raise SystemExit("bench: no tandemrl summary line ('... done: N steps in ... throughput ...') in its output")
    steps, samples_s, tokens_s = int(match.group(1)), float(match.group(2)), float(match.group(3))
    if steps != w.steps:
        raise SystemExit(f"bench: tandemrl ran {steps} steps, expected {w.steps}")
    return Result("tandemrl", w.samples_per_step / samples_s, w.samples_per_step, w.new_tokens, tokens_s / samples_s)


def run_tandemrl(w: Workload, workdir: Path, extra: list[str], threads: int = 0) -> Result:
    """The main job through the launcher; ``threads`` > 0 sets the trainer's OMP_NUM_THREADS (the launcher
    lets a user's value win over its placement's one thread per process)."""
    env = child_env()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = run_logged(tandemrl_command(w, fileroot(workdir), extra), workdir / "tandemrl.log", env)
    return parse_tandemrl(out, w)


def fileroot(workdir: Path) -> str:
    return str(workdir / "tandemrl-runs")


def ensure_bench_venv(venv: Path, requirements: Path = REQUIREMENTS, stamp_name: str = STAMP) -> Path:
    """``venv`` (no system site-packages) with ``requirements`` installed; its python. A stamp of the file's
    hash skips the install while it is unchanged; a failed step is one line naming it."""
    python = venv / "bin" / "python"
    want = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = venv / stamp_name
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return python
    print(f"installing {requirements.relative_to(REPO)} into {venv} (a few minutes) ...", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", "-q", "-r", str(requirements)]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(
                f"bench: cannot install {requirements.name} into {venv}: {' '.join(cmd[-3:])} exited "
                f"{done.returncode}: {last}"
            )
    stamp.write_text(want + "\n")
    return python


def run_trl(
    w: Workload, workdir: Path, extra: list[str], venv: Path, prompts: list[dict[str, Any]], threads: int
) -> Result:
    python = ensure_bench_venv(venv)
    spec = {
        "model_dir": w.model_dir,
        "prompts": prompts,
        "args": trl_args(w, str(workdir / "trl-out"), extra),
        "threads": threads,
    }
    spec_file = workdir / "trl-spec.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(spec_file)]
    out = run_logged(cmd, workdir / "trl.log", child_env())
    lines = [line for line in out.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        raise SystemExit(f"bench: no {RESULT_TAG.strip()} line in the TRL worker's output ({workdir / 'trl.log'})")
    got = json.loads(lines[-1][len(RESULT_TAG) :])
    if got["steps"] != w.steps:
        raise SystemExit(f"bench: TRL ran {got['steps']} steps, expected {w.steps}")
    return Result("TRL", got["train_runtime"] / w.steps, w.samples_per_step, w.new_tokens, got["mean_completion_len"])


# ----------------------------------------------------------------------------- the TRL worker (.venv-bench)


def _last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def gsm8k_correct(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 where the completion's last number is the reference answer's (after ``####``)."""
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        rewards.append(float(_last_number(text) == _last_number(ref.split("####")[-1])))
    return rewards


def trl_worker(spec_file: str) -> None:
    """Train with TRL's GRPOTrainer from the spec the driver wrote; print one result line."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_file).read_text())
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    args = dict(spec["args"])
    args.setdefault("use_cpu", not torch.cuda.is_available())
    config = GRPOConfig(**args)
    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=gsm8k_correct,
        args=config,
        train_dataset=Dataset.from_list(spec["prompts"]),
    )
    model = trainer.model
    print(
        f"TRL worker: torch {torch.__version__} threads={torch.get_num_threads()} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
        f"dtype={next(model.parameters()).dtype} params={sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"gradient_checkpointing={config.gradient_checkpointing} loss_type={config.loss_type} beta={config.beta}",
        flush=True,
    )
    out = trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    result = {
        "steps": trainer.state.global_step,
        "train_runtime": out.metrics["train_runtime"],
        "mean_completion_len": sum(lengths) / max(1, len(lengths)),
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags; a bad one is one ``error:`` line where tandemrl is installed (not in the TRL worker's venv)."""
    parser: type[argparse.ArgumentParser] = argparse.ArgumentParser
    with contextlib.suppress(ImportError):
        from tandemrl.utils.cli import ArgumentParser as parser

    p = parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="25m", help="tiny Qwen2 (0.56M) or ~25M Qwen2")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K dir with train.jsonl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="completion tokens per sample (exact)")
    p.add_argument("--max-prompt-len", type=int, default=256, help="prompts over this many tokens are skipped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tandemrl-overrides", default="", help="extra tandemrl config overrides (placement etc.)")
    p.add_argument("--trl-args", default="", help="extra GRPOConfig key=value (JSON values), e.g. bf16=true")
    p.add_argument("--trl-threads", type=int, default=0, help="torch threads of the TRL process (0: torch's default)")
    p.add_argument(
        "--tandemrl-threads", type=int, default=0, help="OMP_NUM_THREADS of tandemrl's trainer (0: the launcher's)"
    )
    p.add_argument("--only", choices=("both", "tandemrl", "trl"), default="both")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, interleaved (tandemrl, TRL, tandemrl, ...)")
    p.add_argument("--venv", default=str(REPO / ".venv-bench"), help="virtualenv TRL is installed into")
    p.add_argument("--workdir", default="", help="logs and run outputs (default runs/vs_trl/<time>)")
    p.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "group_size", "new_tokens", "max_prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("trl_threads", "tandemrl_threads"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


def workload(args: argparse.Namespace, model_path: str) -> Workload:
    shared = {f.name: getattr(args, f.name) for f in fields(Workload) if f.name not in ("model_dir", "data")}
    return Workload(model_dir=model_path, data=str(Path(args.data).resolve()), **shared)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_dir(workdir: Path, run: int, repeats: int) -> Path:
    """Where run ``run`` (1-based) keeps its logs and outputs: the workdir itself for a single run, else ``runN/``."""
    if repeats == 1:
        return workdir
    path = workdir / f"run{run}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _span(lo_hi: tuple[float, float] | None, fmt: str) -> str:
    return "-" if lo_hi is None else f"{lo_hi[0]:{fmt}}-{lo_hi[1]:{fmt}}"


def report(results: list[tuple[int, Result]], loads: list[str]) -> None:
    """Each run's figures, then the summary over runs (``summarize``) and the load average at start and end."""
    print(
        f"\n{'run':>3s} {'side':10s} {'samples/s':>10s} {'compl. tok/s':>13s} {'s/step':>8s} {'mean compl. len':>16s}"
    )
    for run, r in results:
        print(
            f"{run:3d} {r.name:10s} {r.samples_per_s:10.2f} {r.tokens_per_s:13.0f} {r.s_per_step:8.2f} "
            f"{r.mean_completion_len:16.1f}"
        )
    rates = {name: [r.samples_per_s for _, r in results if r.name == name] for name in ("tandemrl", "TRL")}
    s = summarize(rates["tandemrl"], rates["TRL"])
    for name, median, span in (("tandemrl", s.tandemrl_median, s.tandemrl_range), ("TRL", s.trl_median, s.trl_range)):
        if median is not None and len(rates[name]) > 1:
            print(f"{name}: median {median:.2f} samples/s, min-max {_span(span, '.2f')} over {len(rates[name])} runs")
    if len(s.ratios) == 1:
        print(f"tandemrl / TRL: {s.ratios[0]:.2f}x samples/s")
    elif s.ratio_median is not None:
        print("tandemrl / TRL per pair: " + ", ".join(f"{x:.2f}x" for x in s.ratios))
        print(
            f"tandemrl / TRL: median {s.ratio_median:.2f}x samples/s, spread {_span(s.ratio_range, '.2f')}x "
            f"over {len(s.ratios)} pairs"
        )
    print(f"load average (1/5/15 min): start {loads[0]}, end {loads[-1]}")


def run_all(
    args: argparse.Namespace,
    w: Workload,
    workdir: Path,
    prompts: list[dict[str, Any]],
    extras: tuple[list[str], list[str]],
) -> None:
    """``--repeats`` rounds of the chosen sides, interleaved (tandemrl then TRL each round), then the report.

    ``extras`` are the tandemrl overrides and the TRL arguments.
    """
    sides: list[tuple[str, Callable[[Path], Result]]] = []
    if args.only in ("both", "tandemrl"):
        sides.append(("tandemrl", lambda where: run_tandemrl(w, where, extras[0], args.tandemrl_threads)))
    if args.only in ("both", "trl"):
        sides.append(("TRL", lambda where: run_trl(w, where, extras[1], Path(args.venv), prompts, args.trl_threads)))
    loads, results = [load()], []
    print(f"load average at start: {loads[0]}", flush=True)
    for run in range(1, args.repeats + 1):
        where = run_dir(workdir, run, args.repeats)
        tag = f"run {run}/{args.repeats} " if args.repeats > 1 else ""
        for name, side in sides:
            results.append((run, side(where)))
            loads.append(load())
            print(f"{tag}{name}: {results[-1][1].samples_per_s:.2f} samples/s; load average {loads[-1]}", flush=True)
    report(results, loads)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    if not (Path(args.data) / "train.jsonl").is_file():
        raise SystemExit(f"bench: --data {args.data} has no train.jsonl")
    w = workload(args, model_dir(args.model, args.data))
    t_extra, trl_extra = shlex.split(args.tandemrl_overrides), shlex.split(args.trl_args)
    workdir = Path(args.workdir or REPO / "runs" / "vs_trl" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    trl_args(w, "", trl_extra)  # refuses workload keys before anything runs
    prompts = prompt_rows(tandemrl_config(w, fileroot(workdir), t_extra))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workload: {json.dumps(asdict(w))}\ntandemrl extra: {t_extra}\nTRL extra: {trl_extra}")
    print(f"tandemrl trainer threads: {args.tandemrl_threads or 'the launcher default'}")
    print(f"TRL threads: {args.trl_threads or 'torch default'}; OMP_WAIT_POLICY={child_env()['OMP_WAIT_POLICY']}")
    print(f"runs per side: {args.repeats}{' (interleaved, one runN/ folder each)' if args.repeats > 1 else ''}")
    print(f"logs: {workdir}")
    run_all(args, w, workdir, prompts, (t_extra, trl_extra))


if __name__ == "__main__":
    if "--trl-worker" in sys.argv:  # runs in TRL's venv, where tandemrl is not installed
        main(sys.argv[1:])
    else:
        from tandemrl.utils.machine import measured_on

        with measured_on("vs_trl"):
            main(sys.argv[1:])
