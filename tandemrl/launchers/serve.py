"""Run one inference server in the foreground until SIGTERM: the unit a job scheduler places.

    tandemrl serve --model RUN_DIR/.../final    # one vLLM server on 127.0.0.1, a free port; Ctrl-C stops it

    python -m tandemrl.launchers.serve --backend vllm --model PATH --host NODE --port 8000 \
        --log RUN_DIR/vllm-server-0.log --ready RUN_DIR/servers/0.addr [--tp 1] [--pp 1] [--timeout 600] \
        [--extra JSON] [--request-log RUN_DIR/vllm-server-0-requests.jsonl] \
        [--stall-warn 60 --stall-limit 900 --step vllm-server-0 --failed RUN_DIR/job-ID.failed]

The Slurm launcher's sbatch script starts one of these per server with ``srun``. It waits
until the server is healthy and then writes ``host:port`` to ``--ready`` (atomically), so
the job script on another node can collect the addresses from the shared run directory.
It exits non-zero with a one-line error if the server exits or is not healthy in time, and
stops the server's whole process group on SIGTERM/SIGINT.

While it serves, it probes the server's health route (``server_watch.StallClock``): a server silent for
``--stall-warn`` seconds is reported once; past ``--stall-limit`` the server is stopped, the step is recorded
as the job's failure in ``--failed`` (step, what, log: the job script's format) and the job is cancelled
(``scancel $SLURM_JOB_ID``), so ``--wait`` names the stalled server instead of the trainer timing out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tandemrl.inference.server_auth import TOKEN_ENV
from tandemrl.launchers.server_watch import StallBounds, StallClock, stall_cause, stall_error, stall_warning
from tandemrl.utils.cli import ArgumentParser, first_line, signals_interrupt


def _args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="tandemrl serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (an HF checkpoint, e.g. a run's saved model)")
    p.add_argument("--backend", default="vllm", help="vllm or sglang (default: vllm)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and to advertise (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one, printed when healthy)")
    p.add_argument(
        "--dtype", default=None, help="weights' dtype on the server, e.g. float32 (default: the backend's choice)"
    )
    p.add_argument("--log", default=None, help="server log file (default: ./<backend>-server-<port>.log)")
    p.add_argument("--ready", default=None, help="file that receives host:port once healthy (default: none)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to become healthy")
    p.add_argument("--extra", default="{}", help="JSON object of extra server flags")
    p.add_argument("--request-log", default=None, help="file the server appends each request to (vLLM only)")
    p.add_argument("--stall-warn", type=float, default=60.0, help="seconds without an answer before one warning")
    p.add_argument("--stall-limit", type=float, default=900.0, help="seconds without an answer that stop the job")
    p.add_argument("--step", default="server", help="this step's name in the job's failure record")
    p.add_argument("--failed", default=None, help="the job's failure record (written if absent) on a stall")
    args = p.parse_args(argv)
    if not 0 < args.stall_warn < args.stall_limit:
        p.error(f"need 0 < --stall-warn ({args.stall_warn:g}) < --stall-limit ({args.stall_limit:g})")
    return args


def supervise(server: Any, args: argparse.Namespace) -> int:
    """Until the server exits (1, one line) or stays silent past ``--stall-limit`` (1, recorded, job cancelled)."""
    bounds = StallBounds(args.stall_warn, args.stall_limit)
    clock = StallClock(bounds)
    who = f"{args.backend} server {server.address}"
    while server.is_running():
        event = clock.observe(server.is_answering(timeout=min(5.0, bounds.every)))
        if event is not None and event[0] == "warn":
            print(f"[serve] {stall_warning(who, event[1], bounds)}", flush=True)
        elif event is not None:
            error = stall_error(who, event[1])
            print(f"error: {error}", file=sys.stderr, flush=True)
            _record_failure(args, stall_cause(event[1]))
            return 1
        time.sleep(bounds.every)
    from tandemrl.inference.server import crash_cause

    cause = crash_cause(server.log_file)
    line = f"error: {who} exited with code {server.proc.returncode}" + (f": {cause}" if cause else "")
    print(line, file=sys.stderr, flush=True)
    return 1


def _record_failure(args: argparse.Namespace, what: str) -> None:
    """The job's first failure (if none is recorded yet), then cancel the job so the trainer stops too."""
    if args.failed and not os.path.exists(args.failed):
        tmp = Path(f"{args.failed}.{os.getpid()}.tmp")
        tmp.write_text(f"{args.step}\t{what}\t{args.log}\n")
        os.replace(tmp, args.failed)
    job = os.environ.get("SLURM_JOB_ID")
    scancel = shutil.which("scancel")
    if job and scancel:
        subprocess.run([scancel, job], capture_output=True, check=False)


def _check_model(path: str) -> None:
    """A local checkpoint needs its config.json and a tokenizer, checked before any server starts."""
    from tandemrl.models.hf import check_tokenizer_dir, is_plausible_hub_id

    if not os.path.exists(path):
        if path.startswith(("/", ".", "~")) or not is_plausible_hub_id(path):
            raise FileNotFoundError(f"--model: model directory not found: {path}")
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model: {path} has no config.json (not an HF model directory)")
    check_tokenizer_dir(path, "--model")


def _check_server_args(args: argparse.Namespace) -> None:
    """The backend, --port and --dtype, checked before any server starts (one line naming the flag)."""
    from tandemrl.api.net import port_problem
    from tandemrl.inference.backend import dtype_problem
    from tandemrl.inference.registry import backend_class

    try:
        backend = backend_class(args.backend)
    except ValueError as err:
        raise ValueError(f"--backend: {err}") from None
    problem = port_problem(args.port, args.host)
    if problem is not None:
        raise ValueError(f"--port: {problem}")
    problem = dtype_problem(backend, args.backend, args.dtype) if args.dtype else None
    if problem is not None:
        raise ValueError(f"--dtype: {problem}")
    try:
        extra = json.loads(args.extra)
    except ValueError:
        extra = None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra: expected a JSON object of server flags, got {args.extra!r}")
    unknown = backend().unknown_flags(list(extra))
    if unknown:
        raise ValueError(f"--extra: {args.backend} servers have no flag {unknown[0]}")


def serve(args: argparse.Namespace) -> int:
    """Start, wait healthy, publish the address, then supervise until the server ends or we are told to stop."""
    from tandemrl.api.net import free_port
    from tandemrl.api.types import ParallelStrategy
    from tandemrl.inference.registry import get_backend
    from tandemrl.inference.server import launch_server

    server = None
    try:
        _check_model(args.model)
        _check_server_args(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
        return 2
    with signals_interrupt():
        try:
            port = args.port or free_port(args.host)
            extra = json.loads(args.extra)
            if args.dtype:
                extra["dtype"] = args.dtype
            server = launch_server(
                get_backend(args.backend),
                args.model,
                host=args.host,
                port=port,
                strategy=ParallelStrategy(tp=args.tp, pp=args.pp),
                extra=extra,
                log_file=args.log or f"{args.backend}-server-{port}.log",
                token=os.environ.get(TOKEN_ENV),  # set per job by the Slurm launcher's script
                request_log=args.request_log,
            )
            print(f"[serve] {args.backend} server starting on {server.address} (log {server.log_file})", flush=True)
            server.wait_healthy(timeout=args.timeout)
            if args.ready:
                tmp = f"{args.ready}.tmp"
                os.makedirs(os.path.dirname(os.path.abspath(args.ready)), exist_ok=True)
                with open(tmp, "w") as f:
                    f.write(server.address + "\n")
                os.replace(tmp, args.ready)
            print(f"[serve] {args.backend} healthy at {server.address}", flush=True)
            return supervise(server, args)
        except KeyboardInterrupt:
            return 0
        except Exception as err:
            print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
            return 1
        finally:
            if server is not None:
                server.stop()


def main() -> None:
    raise SystemExit(serve(_args(sys.argv[1:])))


if __name__ == "__main__":
    main()
