"""Local launcher: inference servers + a torchrun trainer on this machine.

    python -m tandemrl.launchers.local SCRIPT --config YAML [key=value ...]
    python -m tandemrl.launchers.local SCRIPT --config YAML --multirun a=1,2 b=x,y

Reads ``allocation_mode``, starts the inference servers it describes on free loopback
ports, waits until they are healthy, exports their addresses in
``TANDEMRL_LLM_SERVER_ADDRS``, runs SCRIPT under torchrun on the training world size with
prefixed logs copied into the run directory, and tears everything down on success,
failure or Ctrl-C. ``--multirun`` runs every combination of the comma-separated values as
its own trial, one after the other, and prints a summary table.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandemrl.inference.remote import SERVER_ADDRS_ENV
from tandemrl.utils.allocation import AllocationMode
from tandemrl.utils.launch_config import LaunchSpec, read_launch_spec


@dataclass
class TrialResult:
    """Outcome of one trial of a (multi)run."""

    trial_name: str
    overrides: list[str]
    returncode: int
    seconds: float
    run_dir: str
    error: str = ""


@dataclass
class _Children:
    """Processes this launcher owns; stopped together on any exit."""

    servers: list = field(default_factory=list)
    trainer: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            _kill_group(self.trainer)
        for server in self.servers:
            server.stop()
        self.servers.clear()


def _kill_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group (torchrun and its workers), then SIGKILL."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            # torchrun's workers may outlive it briefly; make sure the group is gone.
            os.killpg(pgid, signal.SIGKILL)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


def _pump(stream, prefix: str, log_path: Path) -> threading.Thread:
    """Copy a child's output to our stdout (prefixed) and to its log file."""

    def run() -> None:
        with open(log_path, "ab") as log:
            for line in iter(stream.readline, b""):
                log.write(line)
                log.flush()
                sys.stdout.write(f"[{prefix}] {line.decode(errors='replace')}")
                sys.stdout.flush()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def start_servers(spec: LaunchSpec, alloc: AllocationMode, run_dir: Path, children: _Children) -> list[str]:
    """One server per inference data-parallel replica; returns their addresses."""
    from tandemrl.engines.types import ParallelStrategy
    from tandemrl.inference.backend import get_backend
    from tandemrl.inference.server import launch_server

    gen = alloc.gen
    if gen is None:
        return []
    backend = get_backend(gen.backend)
    per_server = ParallelStrategy(tp=gen.strategy.tp, pp=gen.strategy.pp)
    for i in range(gen.strategy.dp):
        server = launch_server(
            backend,
            spec.model_path,
            host="127.0.0.1",
            strategy=per_server,
            extra=spec.server_extra,
            log_file=str(run_dir / f"{gen.backend}-server-{i}.log"),
        )
        children.servers.append(server)
    for server in children.servers:
        server.wait_healthy(timeout=spec.server_timeout)
    return [s.address for s in children.servers]


def run_trial(script: str, config_path: str | None, overrides: list[str], spec: LaunchSpec) -> TrialResult:
    """Start servers, run the trainer, stop everything; never leaves a process behind."""
    alloc = spec.allocation
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    children = _Children()
    start = time.monotonic()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for s in previous:
        signal.signal(s, on_signal)
    try:
        addrs = start_servers(spec, alloc, run_dir, children)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if addrs:
            env[SERVER_ADDRS_ENV] = ",".join(addrs)
            print(f"[launcher] {alloc.gen_backend} servers healthy at {env[SERVER_ADDRS_ENV]}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={alloc.train_world_size}",
        ]
        cmd += [script] + (["--config", config_path] if config_path else []) + overrides
        print(f"[launcher] trainer: {' '.join(cmd)}", flush=True)
        children.trainer = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        pump = _pump(children.trainer.stdout, "trainer", run_dir / "trainer.log")
        rc = children.trainer.wait()
        pump.join(timeout=10)
        error = "" if rc == 0 else f"trainer exited with {rc} (log: {run_dir / 'trainer.log'})"
    except KeyboardInterrupt:
        rc, error = 130, "interrupted"
    except Exception as err:  # a server that would not start, a bad address...
        rc, error = 1, str(err).splitlines()[0] if str(err) else type(err).__name__
    finally:
        children.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return TrialResult(spec.trial_name, overrides, rc, time.monotonic() - start, str(run_dir), error)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of ``key=v1,v2`` overrides (values in brackets are kept whole)."""
    axes: list[list[str]] = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and "," in value and not value.startswith(("[", "{", "'", '"')):
            axes.append([f"{key}={v}" for v in value.split(",")])
        else:
            axes.append([o])
    return [list(combo) for combo in itertools.product(*axes)]


def _trial_suffix(combo: list[str], sweep_keys: set[str]) -> str:
    parts = []
    for o in combo:
        key, _, value = o.partition("=")
        if key in sweep_keys:
            parts.append(f"{key.split('.')[-1]}{value}")
    return "_".join(parts).replace("/", "-")


def parse_args(argv: list[str]) -> tuple[str, str | None, list[str], bool]:
    """SCRIPT, --config path, overrides, multirun flag."""
    if not argv or argv[0].startswith("-"):
        raise ValueError("usage: python -m tandemrl.launchers.local SCRIPT --config YAML [overrides] [--multirun]")
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise FileNotFoundError(f"training script not found: {script}")
    config_path, overrides, multirun = None, [], False
    i = 0
    while i < len(rest):
        a = rest[i]
        if a in ("--multirun", "-m"):
            multirun = True
        elif a == "--config":
            if i + 1 >= len(rest):
                raise ValueError("--config needs a YAML path")
            config_path = rest[i + 1]
            i += 1
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
        else:
            overrides.append(a)
        i += 1
    return script, config_path, overrides, multirun


def main(argv: list[str]) -> int:
    script, config_path, overrides, multirun = parse_args(argv)
    combos = expand_sweep(overrides) if multirun else [overrides]
    sweep_keys = {o.partition("=")[0] for o in overrides if "," in o.partition("=")[2]} if multirun else set()
    # Validate every trial before starting any process: a bad allocation or path fails fast.
    specs = []
    for combo in combos:
        spec = read_launch_spec(config_path, combo)
        if multirun:
            suffix = _trial_suffix(combo, sweep_keys)
            trial = f"{spec.trial_name}_{suffix}" if suffix else spec.trial_name
            combo = [*combo, f"trial_name={trial}"]
            spec = read_launch_spec(config_path, combo)
        specs.append((combo, spec))
    for _, spec in specs:
        spec.resolve_model()
    results = []
    for n, (combo, spec) in enumerate(specs, 1):
        if multirun:
            print(f"[launcher] trial {n}/{len(specs)}: {spec.trial_name} ({' '.join(combo)})", flush=True)
        result = run_trial(script, config_path, combo, spec)
        results.append(result)
        if result.returncode != 0:
            print(f"[launcher] trial {spec.trial_name} failed: {result.error}", flush=True)
            if result.error == "interrupted":
                break
    if multirun:
        print(summary_table(results), flush=True)
    return 0 if all(r.returncode == 0 for r in results) and len(results) == len(specs) else 1


def summary_table(results: list[TrialResult]) -> str:
    """A plain-text table of every trial's status, duration and run directory."""
    rows = [("trial", "status", "seconds", "run dir")]
    for r in results:
        rows.append(
            (r.trial_name, "ok" if r.returncode == 0 else f"FAILED ({r.returncode})", f"{r.seconds:.0f}", r.run_dir)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def cli() -> None:
    try:
        code = main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = 2
    raise SystemExit(code)


if __name__ == "__main__":
    cli()
