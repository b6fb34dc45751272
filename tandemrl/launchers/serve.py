"""Run one inference server in the foreground until SIGTERM: the unit a job scheduler places.

    python -m tandemrl.launchers.serve --backend vllm --model PATH --host NODE --port 8000 \
        --log RUN_DIR/vllm-server-0.log --ready RUN_DIR/servers/0.addr [--tp 1] [--pp 1] [--timeout 600] \
        [--extra JSON] [--request-log RUN_DIR/vllm-server-0-requests.jsonl]

The Slurm launcher's sbatch script starts one of these per server with ``srun``. It waits
until the server is healthy and then writes ``host:port`` to ``--ready`` (atomically), so
the job script on another node can collect the addresses from the shared run directory.
It exits non-zero with a one-line error if the server exits or is not healthy in time, and
stops the server's whole process group on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tandemrl.inference.server_auth import TOKEN_ENV
from tandemrl.utils.cli import first_line, signals_interrupt


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandemrl.launchers.serve", description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, help="vllm or sglang")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--host", required=True, help="address to bind and to advertise (this node's name or IP)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--log", required=True, help="server log file")
    p.add_argument("--ready", required=True, help="file that receives host:port once healthy")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to become healthy")
    p.add_argument("--extra", default="{}", help="JSON object of extra server flags")
    p.add_argument("--request-log", default=None, help="file the server appends each request to (vLLM only)")
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    """Start, wait healthy, publish the address, then supervise until the server ends or we are told to stop."""
    from tandemrl.api.types import ParallelStrategy
    from tandemrl.inference.registry import get_backend
    from tandemrl.inference.server import launch_server

    server = None
    with signals_interrupt():
        try:
            server = launch_server(
                get_backend(args.backend),
                args.model,
                host=args.host,
                port=args.port,
                strategy=ParallelStrategy(tp=args.tp, pp=args.pp),
                extra=json.loads(args.extra),
                log_file=args.log,
                token=os.environ.get(TOKEN_ENV),  # set per job by the Slurm launcher's script
                request_log=args.request_log,
            )
            server.wait_healthy(timeout=args.timeout)
            tmp = f"{args.ready}.tmp"
            os.makedirs(os.path.dirname(os.path.abspath(args.ready)), exist_ok=True)
            with open(tmp, "w") as f:
                f.write(server.address + "\n")
            os.replace(tmp, args.ready)
            print(f"[serve] {args.backend} healthy at {server.address}", flush=True)
            while server.is_running():
                time.sleep(2)
            code = server.proc.returncode
            print(f"error: {args.backend} server on {server.address} exited with code {code}", file=sys.stderr)
            return 1
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
