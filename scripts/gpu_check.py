"""GPU check of the training backends: one line per check, exit status 1 if any check FAILs.

    bash scripts/gpu_check.sh            # a machine with NVIDIA GPUs (NCCL)
    bash scripts/gpu_check.sh --cpu      # dry run on the CPU (gloo, world size 1 and 2), what needs CUDA skips

Checks, each run by scripts/gpu_check_worker.py under torchrun (world sizes from the devices found):

- ``fsdp2_sft_bf16_ws1`` / ``_ws2``: FSDP2 SFT, 5 steps, fp32 weights with bf16 compute; ws2 needs 2 devices;
- ``deepspeed_zero3_bf16_ws1``: DeepSpeed ZeRO-3, bf16, 3 steps;
- ``megatron_tp1_local_bf16`` / ``megatron_tp1_te_bf16``: Megatron-core TP=1, bf16, 3 steps, with the local
  (pure torch) layer spec and with TransformerEngine's (TE and CUDA needed);
- ``parity_<row>``: the rows of the cross-backend parity table (tests/integration/test_backend_parity.py) that fit: a row
  runs as written if its world size fits the devices, a data-parallel-only row shrinks to the devices found
  (``_dN`` in its name; the update does not depend on the DP size), others skip. fp32, compared with the
  table's first row at the test's tolerance;
- ``fsdp2_mfu_bf16``: achieved TFLOP/s and MFU of an FSDP2 bf16 step of a ~0.9B Qwen2 (scripts/gpu_check_mfu.py),
  against the bf16 matmul peak measured in the same run and the nominal dense bf16 peak. Under --cpu the same
  code runs on a tiny model (no meaningful MFU).

The process-group backend and device are never named here: the engines detect them (NCCL on CUDA, gloo on CPU);
--cpu hides the GPUs (CUDA_VISIBLE_DEVICES=""). Worker logs and per-check JSON go to --out.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "scripts" / "gpu_check_worker.py"
PARITY_TABLE = REPO_ROOT / "tests" / "integration" / "test_backend_parity.py"
PARITY_DATA = REPO_ROOT / "tests" / "workers" / "ppo_checks.py"  # its VOCAB: the parity rows' random token range
DEFAULT_GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:?\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b.*)$")


@dataclass
class Check:
    """One line of output: run by a launch (``launch``, ``world``) unless ``skip`` gives the reason why not."""

    name: str
    check: str = ""
    launch: str = ""
    world: int = 1
    skip: str = ""
    row: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (GPUs hidden, gloo)")
    ap.add_argument("--model", default=None, help="tiny HF model dir; default: build/reuse the cached tiny Qwen2")
    ap.add_argument("--out", default=None, help="dir for logs and per-check JSON (default: a new temp dir)")
    ap.add_argument("--max-devices", type=int, default=None, help="use at most this many devices (world size)")
    ap.add_argument("--only", default="", help="comma-separated name prefixes: run only the matching checks")
    ap.add_argument("--launch-timeout", type=float, default=480.0, help="seconds per torchrun launch")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds for all launches; later launches shrink, then skip"
    )
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------- environment


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(cuda: bool, n_dev: int) -> list[str]:
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(n_dev)})
        device = f"{' + '.join(names)} x{n_dev} (driver {driver_version()}, CUDA runtime {torch.version.cuda})"
    else:
        device = f"cpu, {os.cpu_count()} cores, world sizes up to {n_dev} (--cpu dry run)"
    pkgs = ("torch", "transformers", "deepspeed", "megatron-core", "transformer-engine")
    versions = ", ".join(f"{p} {package_version(p) if p != 'torch' else torch.__version__}" for p in pkgs)
    return [f"# gpu_check {now}", f"# device: {device}", f"# {versions}"]


def tiny_model(arg: str | None) -> str:
    if arg:
        if not os.path.isfile(os.path.join(arg, "config.json")):
            raise SystemExit(f"--model: no config.json in {arg}")
        return os.path.abspath(arg)
    from tandemrl.models.make_tiny import ensure_tiny_model

    gsm8k = Path(os.environ.get("TANDEMRL_GSM8K") or DEFAULT_GSM8K)
    corpus = str(gsm8k) if (gsm8k / "train.jsonl").is_file() else None  # None: the built-in generated corpus
    cache = Path(os.environ.get("TANDEMRL_CACHE") or Path("~/.cache/tandemrl").expanduser()) / "tiny-models"
    return ensure_tiny_model(cache, "qwen2", corpus_path=corpus)


# ------------------------------------------------------------------------------------------------- the plan


def module_literals(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """Top-level constants of a python file, read as literals (never imported)."""
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id in names and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    return found


def parity_table() -> tuple[list[dict[str, Any]], float, tuple[str, ...]]:
    """CASES, RTOL and KEYS of tests/integration/test_backend_parity.py (the table stays in one place)."""
    found = module_literals(PARITY_TABLE, ("CASES", "RTOL", "KEYS"))
    return found["CASES"], float(found["RTOL"]), tuple(found["KEYS"])


def parity_vocab_skip(model: str) -> str:
    """Why the parity rows cannot run on ``model`` (their random token ids exceed its vocabulary), or ""."""
    need = int(module_literals(PARITY_DATA, ("VOCAB",))["VOCAB"])
    have = int(json.loads(Path(model, "config.json").read_text()).get("vocab_size", 0))
    return f"needs a tiny model with vocab_size >= {need}, {model} has {have}" if have < need else ""


def parity_checks(n_dev: int) -> list[Check]:
    """The table's rows fitted to ``n_dev`` devices (see the module docstring)."""
    from tandemrl.configs.backends import parse_allocation

    out = []
    for case in parity_table()[0]:
        if case.get("model", "qwen2") != "qwen2":
            continue  # rows of another model (the tiny Llama) run in tests/integration/test_backend_parity.py only
        train = parse_allocation(case["allocation"]).train
        assert train is not None, case
        row = {k: v for k, v in case.items() if k != "critic_export"}  # the export is checked by the test
        world, name = train.world_size, f"parity_{case['name']}"
        s = train.strategy
        if world > n_dev and world == s.dp:
            world, name = n_dev, f"{name}_d{n_dev}"
            row.update(allocation=f"{train.backend}:d{n_dev}", name=f"{case['name']}_d{n_dev}")
        launch = case.get("launch", "shared")
        check = Check(name, "parity:" + json.dumps(row), launch, world, row=row)
        if world > n_dev:
            check.skip = f"needs {world} devices for {case['allocation']}, found {n_dev}"
        out.append(check)
    return out


def plan(cuda: bool, n_dev: int) -> list[Check]:
    have_ds, have_mc = importable("deepspeed"), importable("megatron.core")
    checks = [
        Check("fsdp2_sft_bf16_ws1", "sft:fsdp", "shared", 1),
        Check(
            "fsdp2_sft_bf16_ws2", "sft:fsdp", "shared", 2, skip="" if n_dev >= 2 else f"needs 2 devices, found {n_dev}"
        ),
        Check(
            "deepspeed_zero3_bf16_ws1", "sft:deepspeed", "shared", 1, skip="" if have_ds else "deepspeed not installed"
        ),
        Check(
            "megatron_tp1_local_bf16",
            "sft:megatron",
            "megatron",
            1,
            skip="" if have_mc else "megatron-core not installed",
        ),
    ]
    te = Check("megatron_tp1_te_bf16", "sft:megatron:te", "megatron-te", 1)
    if not cuda:
        te.skip = "TransformerEngine needs CUDA"
    elif not importable("transformer_engine"):
        te.skip = "transformer_engine not installed"
    elif not have_mc:
        te.skip = "megatron-core not installed"
    checks.append(te)
    for c in parity_checks(n_dev):
        backend = c.row["allocation"].split(":")[0]
        if not c.skip and backend == "deepspeed" and not have_ds:
            c.skip = "deepspeed not installed"
        if not c.skip and backend == "megatron" and not have_mc:
            c.skip = "megatron-core not installed"
        checks.append(c)
    checks.append(Check("fsdp2_mfu_bf16", "mfu", "mfu", 1))
    return checks


# ------------------------------------------------------------------------------------------------- launches


def child_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    threads = max(1, min(8, (os.cpu_count() or 1) // nproc))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TANDEMRL_DIST_TIMEOUT", "300")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the parity rows
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def first_error(log: Path) -> str:
    """The first exception line of a launch log, else its last non-empty line."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for line in lines:
        m = ERROR_LINE.match(line.strip())
        if m and not line.strip().startswith("Traceback"):
            return m.group(1)[:300]
    tail = [ln.strip() for ln in lines if ln.strip()]
    return tail[-1][:300] if tail else "no output"


def run_launch(key: str, checks: list[Check], model: str, out: Path, timeout: float) -> dict[str, dict[str, Any]]:
    """One torchrun launch of the worker for ``checks``; their results (a FAIL for any without one)."""
    world = checks[0].world
    tag = f"{key}-ws{world}"
    plan_file, log = out / f"{tag}.plan.json", out / f"{tag}.log"
    plan_file.write_text(json.dumps([{"name": c.name, "check": c.check} for c in checks]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER)]
    cmd += ["--plan", str(plan_file), "--model", model, "--out", str(out)]
    if key == "megatron":
        cmd.append("--local-spec")
    for c in checks:
        (out / f"{c.name}.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    rc: int | str
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, env=child_env(world), cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    print(f"# launch {tag}: {len(checks)} checks in {time.perf_counter() - t0:.0f} s, exit {rc}, log {log}", flush=True)
    results = {}
    for c in checks:
        path = out / f"{c.name}.json"
        if path.is_file():
            results[c.name] = json.loads(path.read_text())
        else:
            results[c.name] = {"status": "FAIL", "reason": f"no result (launch exit {rc}): {first_error(log)}"}
    return results


# ------------------------------------------------------------------------------------------------- lines


def sft_line(name: str, r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"CHECK {name} FAIL ({r.get('reason', 'unknown')})"
    losses = r["losses"]
    return (
        f"CHECK {name} ok loss {losses[0]:.3f}->{losses[-1]:.3f} {r['s_per_step']:.3f} s/step "
        f"({len(losses)} steps, first {r['first_step_s']:.2f} s; {r['backend']}, {r['device']}, "
        f"world {r['world']}, params {r['params_dtype']})"
    )


def parity_lines(checks: list[Check], results: dict[str, dict[str, Any]]) -> list[str]:
    """Each fitted row against the first (reference) row, as the parity test compares them."""
    if not checks:
        return []
    _, rtol, keys = parity_table()
    ref_check = checks[0]
    ref = results.get(ref_check.name, {})
    lines = []
    for c in checks:
        r = results.get(c.name, {})
        if c.skip:
            lines.append(f"CHECK {c.name} skip ({c.skip})")
            continue
        if r.get("status") != "ok":
            lines.append(f"CHECK {c.name} FAIL ({r.get('reason', 'unknown')})")
            continue
        where = f"{r['backend']}, world {r['world']}, fp32"
        v = r["values"]
        if c is ref_check:
            lines.append(
                f"CHECK {c.name} ok reference: sft loss {v['sft_loss'][0]:.4f}->{v['sft_loss'][-1]:.4f}, ppo loss "
                f"{v['ppo_loss'][-1]:.4g}, critic loss {v['critic_loss'][-1]:.4g} ({where})"
            )
            continue
        if ref.get("status") != "ok":
            lines.append(f"CHECK {c.name} FAIL (reference {ref_check.name} did not run)")
            continue
        worst, worst_key, bad = 0.0, keys[0], []
        for key in keys:
            for got, want in zip(v[key], ref["values"][key], strict=True):
                diff = abs(got - want)
                rel = diff / abs(want) if want else (0.0 if diff == 0 else float("inf"))
                if rel > worst:
                    worst, worst_key = rel, key
                if diff > max(rtol * abs(want), 1e-12):
                    bad.append(key)
        diff_text = f"max rel diff {worst:.1e} ({worst_key}) vs {ref_check.name} over {len(keys)} series"
        if bad:
            lines.append(
                f"CHECK {c.name} FAIL ({', '.join(sorted(set(bad)))} outside rel {rtol:g}; {diff_text}; {where})"
            )
        else:
            lines.append(f"CHECK {c.name} ok {diff_text} ({where})")
    return lines


def mfu_line(name: str, r: dict[str, Any]) -> str:
    from gpu_check_mfu import summary

    if r["status"] != "ok":
        return f"CHECK {name} FAIL ({r.get('reason', 'unknown')})"
    return f"CHECK {name} ok {summary(r['result'])} ({r['backend']}, {r['device']})"


# --------------------------------------------------------------------------------------------------- main


def selected(checks: list[Check], only: str) -> list[Check]:
    prefixes = [p for p in only.split(",") if p]
    keep = [c for c in checks if not prefixes or any(c.name.startswith(p) for p in prefixes)]
    ref = next(c for c in checks if c.name.startswith("parity_"))
    if any(c.name.startswith("parity_") for c in keep) and ref not in keep:
        keep.insert(0, ref)  # rows are compared with the reference row
    return keep


def run_all(checks: list[Check], model: str, out: Path, timeout: float, deadline: float) -> dict[str, dict[str, Any]]:
    """Launch the runnable checks grouped by (launch, world), in plan order; their results by name.

    A launch gets ``timeout`` seconds, or what is left before ``deadline`` (time.monotonic()); with less than
    a minute left its checks skip.
    """
    groups: dict[tuple[str, int], list[Check]] = {}
    for c in checks:
        if not c.skip:
            groups.setdefault((c.launch, c.world), []).append(c)
    results: dict[str, dict[str, Any]] = {}
    for (key, _), group in groups.items():
        left = deadline - time.monotonic()
        if left < 60:
            for c in group:
                c.skip = "time budget spent before its launch"
            continue
        results.update(run_launch(key, group, model, out, min(timeout, left)))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA, here and in the workers
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        print("gpu_check: no CUDA device visible; run with --cpu for the CPU dry run", file=sys.stderr)
        return 2
    n_dev = torch.cuda.device_count() if cuda else min(2, os.cpu_count() or 1)
    n_dev = min(n_dev, args.max_devices) if args.max_devices else n_dev
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    print("\n".join(header(cuda, n_dev)), flush=True)
    model = tiny_model(args.model)
    checks = selected(plan(cuda, n_dev), args.only)
    vocab_skip = parity_vocab_skip(model)
    for c in checks:
        if c.name.startswith("parity_") and not c.skip and vocab_skip:
            c.skip = vocab_skip
    print(f"# tiny model: {model}; logs and results: {out}", flush=True)
    mfu = [c for c in checks if c.launch == "mfu"]
    deadline = time.monotonic() + (args.time_budget if args.time_budget is not None else float("inf"))
    results = run_all([c for c in checks if c.launch != "mfu"], model, out, args.launch_timeout, deadline)
    lines = []
    for c in checks:
        if c.launch == "mfu" or c.name.startswith("parity_"):
            continue
        lines.append(f"CHECK {c.name} skip ({c.skip})" if c.skip else sft_line(c.name, results[c.name]))
    lines += parity_lines([c for c in checks if c.name.startswith("parity_")], results)
    print("\n".join(lines), flush=True)
    results.update(run_all(mfu, model, out, args.launch_timeout, deadline))
    for c in mfu:
        lines.append(f"CHECK {c.name} skip ({c.skip})" if c.skip else mfu_line(c.name, results[c.name]))
        print(lines[-1], flush=True)
    failed = [ln.split()[1] for ln in lines if ln.split()[2] == "FAIL"]
    print(f"# {len(lines)} checks: {len(failed)} FAIL" + (f" ({', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
