"""Where a GRPO step's time goes, per process: py-spy (native frames) on the vs_trl workload's tandemrl run.

Starts the tandemrl side of ``bench/vs_trl.py`` (the main job's config, the bench's workload, any
placement through ``--overrides``), waits until ``--warmup`` steps are done, then samples every
process of the run at once for ``--window`` seconds with py-spy (``record --native --threads``):
the launcher's trainer rank, the vLLM API server, its EngineCore (which runs the model on a
one-device CPU server without a core list) and its Worker (which runs it otherwise, e.g. colocated). Each sample is sorted into a phase by the frames on its stack (``PHASES``),
or is idle when the thread sits in a system call under a waiting Python function (``WAITS``). The
report gives, per process, seconds per step in each phase over the steps that ended inside the
window, and the trainer's own timers (``stats.jsonl``) for each of those steps. py-spy comes from
its own virtualenv (``.venv-profile``, ``bench/requirements-profile.txt``), built on first use.
A benchmark: it asserts nothing.

    python bench/step_timeline.py --model tiny                # default placement (async, disaggregated)
    python bench/step_timeline.py --model tiny --overrides "allocation_mode=vllm:d1|fsdp:d1 async_training=false"
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402 - the bench's workload and the tandemrl command

REPO = vs_trl.REPO
REQUIREMENTS = REPO / "bench" / "requirements-profile.txt"
STAMP = ".profile-deps"
# (process, phase, markers): the first phase with a marker in a sample's stack names it.
PHASES: list[tuple[str, str, tuple[str, ...]]] = [
    ("trainer", "weight push", ("push_weights", "weights/push.py", "_push_collective")),
    ("trainer", "rollout wait", ("prepare_batch", "rollout_wait", "wait_batch", "executor.py")),
    ("trainer", "optimizer", ("optimizer_step", "/optim/", "clip_grad")),
    ("trainer", "fwd+bwd", ("_engine_run_backward", "train_minibatches", "_train_micro_batches", "compute_logp")),
    ("trainer", "advantages", ("compute_advantages",)),
    ("trainer", "workflow (decode, reward)", ("workflows/", "_run_episode", "rewards/")),
    ("trainer", "HTTP/client", ("aiohttp", "inference/http.py", "inference/remote.py")),
    ("server", "weight load", ("tandemrl_recv_weights", "reload_weights", "tandemrl_update_from_disk")),
    ("server", "model forward", ("execute_model", "_model_forward", "model_runner")),
    ("server", "sampling", ("sampler", "sample_tokens")),
    ("server", "scheduler", ("schedule", "scheduler.py")),
    ("server", "output/IPC", ("process_output", "output_processor", "zmq", "serial_utils", "msgspec")),
    ("server", "HTTP/API", ("uvicorn", "starlette", "fastapi", "serving_", "api_server", "h11")),
    ("server", "tokenizer", ("tokeniz", "detokeniz")),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tandemrl.utils.cli import ArgumentParser

    p = ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=sorted(vs_trl.MODELS), default="tiny")
    p.add_argument("--data", default=str(vs_trl.DEFAULT_DATA))
    p.add_argument("--steps", type=int, default=40, help="training steps of the run")
    p.add_argument("--warmup", type=int, default=8, help="steps done before sampling starts")
    p.add_argument("--window", type=float, default=20.0, help="seconds sampled")
    p.add_argument("--rate", type=int, default=20, help="py-spy samples per second")
    p.add_argument("--overrides", default="", help="extra tandemrl config overrides (placement etc.)")
    p.add_argument("--venv", default=str(REPO / ".venv-profile"), help="virtualenv py-spy is installed into")
    p.add_argument("--workdir", default="", help="logs and profiles (default runs/step_timeline/<time>)")
    a = p.parse_args(argv)
    if a.warmup < 1 or a.steps <= a.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3 and --warmup must be >= 1")
    if a.window <= 0 or a.rate < 1:
        p.error("--window must be > 0 and --rate >= 1")
    return a


def ensure_pyspy(venv: Path) -> Path:
    """``venv`` with ``requirements-profile.txt`` installed (``vs_trl.ensure_bench_venv``); its py-spy."""
    return vs_trl.ensure_bench_venv(venv, REQUIREMENTS, STAMP).parent / "py-spy"


def stats_rows(fileroot: Path) -> list[dict[str, Any]]:
    files = sorted(fileroot.glob("logs/**/stats.jsonl"))
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def role(cmdline: list[str], name: str) -> str | None:
    text = " ".join(cmdline)
    if "lifeline" in text:  # tandemrl.utils.lifeline supervises a process; it runs nothing itself
        return None
    if "EngineCore" in name or "EngineCore" in text:
        return "server engine"
    if "VLLM::Worker" in name or "VLLM::Worker" in text:  # vLLM's multiprocess executor (a core list is bound)
        return "server worker"
    if "tandemrl.inference.server" in text or "vllm" in text and "serve" in text or "api_server" in text:
        return "server API"
    if "examples/" in text and "torchrun" not in text and "launchers" not in text:
        return "trainer"
    return None


def run_processes(launcher: int) -> dict[str, int]:
    """The run's processes by role (trainer rank, server API, server engine) among ``launcher``'s descendants."""
    import psutil

    out: dict[str, int] = {}
    for proc in psutil.Process(launcher).children(recursive=True):
        try:
            r = role(proc.cmdline(), proc.name())
        except psutil.Error:
            continue
        if r is not None:  # the deepest match: a supervisor's command line names the process it runs
            out[r] = proc.pid
    return out


def sample(pyspy: Path, procs: dict[str, int], window: float, rate: int, workdir: Path) -> dict[str, Path]:
    """py-spy on every process at once for ``window`` seconds; the raw profile of each."""
    jobs, files = [], {}
    for r, pid in procs.items():
        files[r] = workdir / f"{r.replace(' ', '_')}.txt"
        cmd = [str(pyspy), "record", "--pid", str(pid), "--native", "--threads", "--idle"]
        cmd += ["-r", str(rate), "-d", str(int(round(window))), "-f", "raw", "-o", str(files[r])]
        jobs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for job in jobs:
        _, err = job.communicate()
        if job.returncode != 0:
            print(f"py-spy failed: {err.strip().splitlines()[:1]}", flush=True)
    return {r: f for r, f in files.items() if f.exists()}


# A sample is idle time when the thread sits in a blocking call: one of these names among its innermost native
# frames, or an unnamed libc frame under a waiting Python function (WAITS). py-spy's own idle test (without
# ``--idle``) counted threads waiting on a queue as busy.
BLOCKING = ("nanosleep", "epoll_wait", "epoll_pwait", "futex", "sem_wait", "sem_timedwait", "sem_clockwait")
BLOCKING += ("pthread_cond", "PyThread_acquire_lock", "time_sleep", "select_epoll", "select_poll", "sock_recv")
BLOCKING += ("sock_accept", "os_waitpid", "zmq_poll", "uv__io_poll", "uv_run", "__poll", "recvmsg", "recvfrom")
BLOCKING += ("os_read",)  # a pipe read (vLLM's DeathPipeMonitor)
WAITS = {"wait", "select", "poll", "sleep", "get", "join", "_wait_for_tstate_lock", "acquire", "_worker", "accept"}
WAITS |= {"recv", "recv_into", "read", "readline", "wait_for", "result", "recv_multipart", "_poll", "run_forever"}


def phase_of(stack: str, kind: str) -> str:
    frames = stack.split(";")
    python = [f for f in frames if ".py:" in f]
    waiting = any(b in f for f in frames[-3:] for b in BLOCKING)
    if not waiting and frames[-1].startswith("0x") and "(libc.so" in frames[-1] and python:
        waiting = python[-1].split(" (", 1)[0].split(".")[-1] in WAITS
    phase = next((ph for proc, ph, markers in PHASES if proc == kind and any(m in stack for m in markers)), "")
    if waiting:
        return f"idle ({phase})" if phase else "idle"
    return phase or "other (Python, native)"


def split(profile: Path, kind: str, rate: int) -> dict[str, dict[str, float]]:
    """Seconds per thread and phase of one raw py-spy profile (``--idle``: every thread at every tick)."""
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for line in profile.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, _, rest = stack.partition(";")
        out[thread.split(": ", 1)[-1]][phase_of(rest, kind)] += int(count) / rate
    return out


def report(profiles: dict[str, Path], steps: list[dict[str, Any]], window: float, rate: int) -> None:
    """Per process: its main thread's phases (idle split by what it waited in), then every other thread's busy
    time summed by phase; seconds per step over the window's steps."""
    n = max(len(steps), 1)
    print(
        f"\nper step: mean over the {len(steps)} steps that ended in the {window:.1f} s window ({window / n:.3f} s/step)"
    )
    print("| process | thread | phase | s/step | share of the step |")
    print("| --- | --- | --- | --- | --- |")
    for r, path in profiles.items():
        threads = split(path, "trainer" if r == "trainer" else "server", rate)
        main = threads.pop("MainThread", {})
        for phase, sec in sorted(main.items(), key=lambda kv: -kv[1]):
            print(f"| {r} | main | {phase} | {sec / n:.3f} | {sec / window:.0%} |")
        others: dict[str, float] = collections.defaultdict(float)
        for phases in threads.values():
            for phase, sec in phases.items():
                if not phase.startswith("idle"):
                    others[phase] += sec
        for phase, sec in sorted(others.items(), key=lambda kv: -kv[1]):
            if sec >= 0.01 * window:
                print(f"| {r} | {len(threads)} other threads, busy | {phase} | {sec / n:.3f} | {sec / window:.0%} |")
    keys = ["timeperf/step", "timeperf/rollout_wait", "timeperf/actor/ppo_actor/update/fwd_bwd"]
    keys += ["timeperf/actor/ppo_actor/update/optimizer_step", "timeperf/update_weights"]
    print("\nthe trainer's own timers (stats.jsonl, seconds) for those steps:")
    print("| step | " + " | ".join(k.removeprefix("timeperf/").split("/")[-1] for k in keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    for row in steps:
        print(f"| {row.get('step')} | " + " | ".join(f"{row.get(k, float('nan')):.3f}" for k in keys) + " |")


def unprofiled(rows: list[dict[str, Any]], warmup: int, first: int) -> str:
    """The mean step time of the warm steps before sampling started (the profiler's cost, by comparison)."""
    steps = [r["timeperf/step"] for r in rows[warmup // 2 : first] if "timeperf/step" in r]
    return f"{sum(steps) / len(steps):.3f} s over steps {warmup // 2 + 1}-{first}" if steps else "-"


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    pyspy = ensure_pyspy(Path(a.venv))
    w = vs_trl.Workload(model_dir=vs_trl.model_dir(a.model, a.data), data=str(Path(a.data).resolve()), steps=a.steps)
    workdir = Path(a.workdir or REPO / "runs" / "step_timeline" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    fileroot = Path(vs_trl.fileroot(workdir))
    cmd = vs_trl.tandemrl_command(w, str(fileroot), shlex.split(a.overrides))
    print(f"run: {shlex.join(cmd)}\nlogs: {workdir}", flush=True)
    with open(workdir / "tandemrl.log", "w") as log:
        run = subprocess.Popen(cmd, cwd=REPO, env=vs_trl.child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            while len(stats_rows(fileroot)) < a.warmup and run.poll() is None:
                time.sleep(0.2)
            procs = run_processes(run.pid)
            print(f"processes: {procs}", flush=True)
            first, start = len(stats_rows(fileroot)), time.perf_counter()
            profiles = sample(pyspy, procs, a.window, a.rate, workdir)
            rows, window = stats_rows(fileroot), time.perf_counter() - start
            if run.wait() != 0:
                raise SystemExit(f"bench: the run exited {run.returncode}; log {workdir / 'tandemrl.log'}")
        finally:
            if run.poll() is None:
                run.terminate()
                run.wait()
    summary = vs_trl.SUMMARY.search((workdir / "tandemrl.log").read_text(errors="replace"))
    if summary:
        print(f"run: {summary.group(2)} samples/s over {summary.group(1)} steps (profiled)")
    print(f"mean step before sampling: {unprofiled(rows, a.warmup, first)}")
    report(profiles, rows[first:], window, a.rate)


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("step_timeline"):
        main(sys.argv[1:])
