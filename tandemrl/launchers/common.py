"""What every launcher shares: the CLI, sweep expansion, the trial loop and its summary.

The launchers differ only in where one trial's processes run (``local``: this machine,
``ray``: actors on a Ray cluster, ``slurm``: an sbatch job), so everything around that —
reading and validating the config before any process starts, naming sweep trials,
turning Ctrl-C/SIGTERM into a clean teardown, one-line errors — lives here once.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tandemrl.configs.utils import finished_run
from tandemrl.launchers import dry_run
from tandemrl.launchers.check import check_script
from tandemrl.launchers.launch_config import LaunchError as LaunchError  # re-exported: the launchers raise it
from tandemrl.launchers.launch_config import LaunchSpec, read_launch_spec
from tandemrl.launchers.run_lock import run_dir_lock
from tandemrl.utils.cli import first_line, interrupted_exit_code, os_error_reason, signals_interrupt
from tandemrl.utils.lifeline import exit_status
from tandemrl.utils.quiet import quiet_process


@dataclass
class TrialResult:
    """Outcome of one trial of a (multi)run."""

    trial_name: str
    overrides: list[str]
    returncode: int
    seconds: float
    run_dir: str
    error: str = ""
    log: str = ""  # where the full output of a failed trial is, printed after its error


@dataclass
class LaunchArgs:
    """A launcher's command line: SCRIPT, ``--config``, overrides and launcher options."""

    script: str
    config_path: str | None
    overrides: list[str]
    multirun: bool = False
    flags: set[str] = field(default_factory=set)  # boolean options given, e.g. {"--dry-run"}
    options: dict[str, str] = field(default_factory=dict)  # valued options, e.g. {"--partition": "gpu"}


def parse_args(
    argv: Sequence[str],
    prog: str,
    flags: Sequence[str] = ("--multirun",),
    options: Sequence[str] = (),
) -> LaunchArgs:
    """Split argv into SCRIPT, ``--config``, the launcher's own ``flags``/``options`` and overrides.

    Anything that is not ours is a config override passed to the script unchanged.
    """
    usage_opts = " ".join(f"[{f}]" for f in flags) + "".join(f" [{o} X]" for o in options)
    if not argv or argv[0].startswith("-"):
        raise ValueError(f"usage: python -m {prog} SCRIPT --config YAML [overrides] {usage_opts}".rstrip())
    script, rest = argv[0], list(argv[1:])
    if not os.path.isfile(script):
        raise FileNotFoundError(f"training script not found: {script}")
    args = LaunchArgs(script, None, [])
    valued = ("--config", *options)
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, value = a.partition("=")
        if a in flags or (a == "-m" and "--multirun" in flags):
            args.flags.add("--multirun" if a == "-m" else a)
        elif name in valued:
            if not eq:
                if i + 1 >= len(rest):
                    raise ValueError(f"{name} needs a value")
                value = rest[i + 1]
                i += 1
            if name == "--config":
                args.config_path = value
            else:
                args.options[name] = value
        else:
            args.overrides.append(a)
        i += 1
    args.multirun = "--multirun" in args.flags
    return args


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


def _finished(spec: LaunchSpec) -> bool:
    """Whether the trial's recoverable checkpoint says it already ran to its end (said in one line): relaunched
    with recovery on, it would start its servers and trainer to train nothing."""
    if spec.recover_mode == "disabled":
        return False
    state = finished_run(spec.fileroot, spec.experiment_name, spec.trial_name, spec.length)
    if state is None:
        return False
    model = state.get("final_model") or "none saved (saver.save_final=false)"
    print(
        f"[launcher] trial {spec.trial_name} already finished ({int(state['global_step']) + 1} steps): nothing to "
        f"start; final model: {model}; launch with another trial_name, or recover.mode=disabled to start over",
        flush=True,
    )
    return True


def plan_trials(args: LaunchArgs) -> list[tuple[list[str], LaunchSpec]]:
    """Every trial's overrides and spec, validated before any process starts; trials that already finished
    (their recoverable checkpoint says so) are left out, each named in one line.

    A bad allocation, config key or model path fails here, so a sweep never half-runs.
    """
    overrides = args.overrides
    combos = expand_sweep(overrides) if args.multirun else [overrides]
    sweep_keys = {o.partition("=")[0] for o in overrides if "," in o.partition("=")[2]} if args.multirun else set()
    specs = []
    for combo in combos:
        spec = read_launch_spec(args.config_path, combo)
        if args.multirun:
            suffix = _trial_suffix(combo, sweep_keys)
            trial = f"{spec.trial_name}_{suffix}" if suffix else spec.trial_name
            combo = [*combo, f"trial_name={trial}"]
            spec = read_launch_spec(args.config_path, combo)
        specs.append((combo, spec))
    specs = [(combo, spec) for combo, spec in specs if not _finished(spec)]  # before any process starts
    reports = check_script_inputs(args, specs)  # first: a bad data file is named in data words, not while
    for _, spec in specs:  # a tiny: model's tokenizer is trained on it
        spec.resolve_model()
    if dry_run.FLAG in args.flags:
        dry_run.print_reports(args.script, specs, reports)
    return specs


def refuse_local_only(specs: list[tuple[list[str], LaunchSpec]], launcher: str) -> None:
    """What only the local launcher does yet (auxiliary servers; running servers given in ``rollout.server_addrs``)
    is refused by the others before anything starts (one line)."""
    for _, spec in specs:
        if spec.aux_servers:
            names = ", ".join(a.name for a in spec.aux_servers)
            raise ValueError(
                f"allocation_mode '{spec.allocation}': auxiliary servers ({names}) are started by the local "
                f"launcher only; the {launcher} launcher does not start them yet"
            )
        if spec.server_addrs:
            raise ValueError(
                f"rollout.server_addrs: running servers are used by the local launcher only; the {launcher} "
                "launcher starts its own (leave rollout.server_addrs empty)"
            )


def check_script_inputs(args: LaunchArgs, specs: list[tuple[list[str], LaunchSpec]]) -> list[str | None]:
    """Validate each trial's config against the script's own schema, and its data files, before any start.

    A bad key, value or dataset row raises ValueError with the script's one-line error. With
    ``--dry-run``, returns each trial's report (``tandemrl.launchers.dry_run``); else Nones.
    """
    reports: list[str | None] = [None] * len(specs)
    with tempfile.TemporaryDirectory(prefix="tandemrl-dry-run-") as tmp:
        for n, (combo, _) in enumerate(specs):
            file = os.path.join(tmp, f"trial{n}.txt") if dry_run.FLAG in args.flags else None
            if not check_script(args.script, args.config_path, combo, file):
                print(
                    f"[launcher] note: {args.script} does not build its config with load_config; not checked",
                    flush=True,
                )
                return [None] * len(specs)
            if file is not None:
                reports[n] = Path(file).read_text(encoding="utf-8")
    return reports


RunTrial = Callable[[str, "str | None", list[str], LaunchSpec], TrialResult]


def run_trials(args: LaunchArgs, specs: list[tuple[list[str], LaunchSpec]], run_trial: RunTrial) -> int:
    """Run the trials one after the other; 0 only if all succeeded, 1 if one failed; a signal stops the sweep
    and gives its code (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    results = []
    for n, (combo, spec) in enumerate(specs, 1):
        if args.multirun:
            print(f"[launcher] trial {n}/{len(specs)}: {spec.trial_name} ({' '.join(combo)})", flush=True)
        result = run_trial(args.script, args.config_path, combo, spec)
        results.append(result)
        if result.returncode != 0:
            print(f"[launcher] trial {spec.trial_name} failed: {result.error}", flush=True)
            if result.log:
                print(f"[launcher] full output: {result.log}", flush=True)
            if result.error == "interrupted":
                break
    if args.multirun:
        print(summary_table(results), flush=True)
    if results and results[-1].error == "interrupted":
        return results[-1].returncode  # 130/143/129: a wrapper tells "interrupted" from "failed"
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


TORCHRUN_LOG_DIR = "torchrun"  # under the run directory: torchrun's per-rank error files


def torchrun_log_args(run_dir: Path) -> list[str]:
    """torchrun options that put each rank's error file (``TORCHELASTIC_ERROR_FILE``) under the run dir."""
    return [f"--log-dir={run_dir / TORCHRUN_LOG_DIR}"]


def first_rank_error(run_dir: Path, since_ns: int = 0) -> tuple[int, str] | None:
    """(rank, first line) of the earliest error a rank recorded after ``since_ns`` (see ``record_error``)."""
    found = []
    for path in (run_dir / TORCHRUN_LOG_DIR).glob("*/attempt_*/*/error.json"):
        try:
            mtime = path.stat().st_mtime_ns
            message = json.loads(path.read_text())["message"]
            text = message["message"] if isinstance(message, dict) else str(message)
            rank = int(path.parent.name)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        lines = [line.strip() for line in str(text).splitlines() if line.strip()]
        if mtime >= since_ns and lines:
            found.append((mtime, rank, lines[0]))
    return min(found)[1:] if found else None


def trainer_failure(run_dir: Path, returncode: int, since_ns: int, printed: str | None = None) -> str:
    """One line for a failed torchrun trainer: the first rank's error if one was recorded, else the first
    ``error:`` line the trainer ``printed`` (a full disk leaves no error file), else its exit status."""
    first = first_rank_error(run_dir, since_ns)
    if first is not None:
        return f"trainer rank {first[0]}: {first[1]}"
    if printed:
        return f"trainer: {printed}"
    return f"trainer {exit_status(returncode)}"


def guarded_trial(
    spec: LaunchSpec,
    overrides: list[str],
    body: Callable[[Path], tuple[int, str]],
    teardown: Callable[[], None],
) -> TrialResult:
    """Run ``body(run_dir) -> (returncode, error)``; ``teardown`` runs whatever happens.

    Ctrl-C/SIGTERM/SIGHUP give 130/143/129 "interrupted"; any other exception gives 1 and its first line. The trial holds its
    run directory's lock (``run_lock``) throughout: a directory a live run holds gives 1 and nothing starts.
    """
    run_dir = Path(spec.run_dir)
    start = time.monotonic()
    _ECHO.set()
    with signals_interrupt():
        try:
            with run_dir_lock(run_dir):
                try:
                    rc, error = body(run_dir)
                finally:
                    _ECHO.clear()  # what the children print while they are stopped goes to their logs only
                    teardown()
        except KeyboardInterrupt as err:
            rc, error = interrupted_exit_code(err), "interrupted"
        except Exception as err:  # a server that would not start, a lost actor, a bad address, a locked dir...
            rc, error = 1, first_line(err)
    return TrialResult(spec.trial_name, overrides, rc, time.monotonic() - start, str(run_dir), error)


def kill_group(proc: subprocess.Popen[Any], grace: float = 15.0) -> None:
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


def write_prefixed(line: bytes, prefix: str, log: IO[bytes] | None = None) -> None:
    """One child line to our stdout as ``[prefix] line`` (and raw to its log file)."""
    if log is not None:
        log.write(line)
        log.flush()
    text = line.decode(errors="replace")
    sys.stdout.write(f"[{prefix}] {text}" + ("" if text.endswith("\n") else "\n"))
    sys.stdout.flush()


# Whether children's output reaches the console: on for a trial's life, off once its teardown starts (the
# shutdown noise of servers and torchrun stays in their logs; the launcher's summary lines follow).
_ECHO = threading.Event()
_ECHO.set()


class Pump(threading.Thread):
    """The thread :func:`pump` starts; ``first_error`` is the first ``error: ...`` line the child printed
    (without the prefix), the cause a summary can name when no rank's error file could be written."""

    first_error: str | None = None


def pump(stream: IO[bytes], prefix: str, log_path: Path) -> Pump:
    """Copy a child's output to our stdout (prefixed) and to its log file. A log file that cannot be written
    (a full disk) is reported once and dropped; the child's output keeps flowing to stdout, so the child
    never blocks on a full pipe."""

    def run() -> None:
        log: IO[bytes] | None = None
        try:
            log = open(log_path, "ab")  # noqa: SIM115 (closed below, or dropped when it fails)
        except OSError as e:
            _log_lost(log_path, e)
        for line in iter(stream.readline, b""):
            if t.first_error is None and line.startswith(b"error: "):
                t.first_error = line[len(b"error: ") :].decode(errors="replace").strip()
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError as e:
                    _log_lost(log_path, e)
                    _close_quietly(log)
                    log = None
            if _ECHO.is_set():
                write_prefixed(line, prefix)
        if log is not None:
            _close_quietly(log)

    t = Pump(target=run, daemon=True)
    t.start()
    return t


def _log_lost(path: Path, err: OSError) -> None:
    print(f"[launcher] cannot write {path}: {os_error_reason(err)}; its output goes to this console only", flush=True)


def _close_quietly(log: IO[bytes]) -> None:
    try:
        log.close()
    except OSError:
        pass


def cli(main: Callable[[list[str]], int]) -> None:
    """Run ``main(argv)``; bad input is one ``error:`` line on stderr and exit code 2."""
    quiet_process()  # before any child starts: servers and trainer ranks inherit the settings
    try:
        code = main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
        code = 2
    except LaunchError as err:
        print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
        code = 1
    raise SystemExit(code)
