"""``torchrun --standalone`` whose rendezvous stores listen on loopback only.

``python -m tandemrl.launchers.torchrun_loopback [torchrun args]`` is torchrun, except that every TCPStore it
hosts on this machine (the c10d rendezvous store of ``--standalone``, the workers' store) is handed a socket
bound to 127.0.0.1, the way ``tandemrl.weights.group`` hosts its store: TCPStore's own server
listens on every interface, where anything that can reach the host could join or read the rendezvous.
Only for one-node runs (the local launcher); multi-node rendezvous must listen where the other nodes are.
When torchrun stops it exits with the code alone: after a signal with 128 + its number, silently; after
failed ranks with 1, its failure report (each rank's error and traceback) appended to ``$TANDEMRL_TRAINER_LOG``
(the launcher's trainer.log) rather than printed, so the console ends with the launcher's summary.

Check with ``ss -ltnp`` while a run trains: no torchrun listener on ``*``/``::``/``0.0.0.0``.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from tandemrl.utils.cli import TRAINER_LOG_ENV, first_line

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _bound_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


def loopback_store_class(base: type[Any]) -> type[Any]:
    """A TCPStore subclass that hosts its server on a 127.0.0.1 socket when asked for a loopback host."""

    def __init__(self: Any, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
        names = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd")
        kwargs.update(zip(names, args, strict=False))
        if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None and host_name in LOOPBACK_NAMES:
            sock = _bound_socket(int(port))
            port = sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here on
            kwargs["use_libuv"] = False  # the listen-fd path is the classic backend's
            host_name = "127.0.0.1"
        base.__init__(self, host_name, port, **kwargs)

    return type("LoopbackTCPStore", (base,), {"__init__": __init__})


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    from torch.distributed.run import main as torchrun_main

    store = loopback_store_class(dist.TCPStore)
    vars(dist)["TCPStore"] = store  # torch.distributed.elastic.utils.distributed reads dist.TCPStore
    vars(c10d_backend)["TCPStore"] = store  # imported by name there
    sys.argv[0] = "torchrun"
    sys.exit(run_quietly(torchrun_main))


def run_quietly(torchrun_main: Any) -> int:
    """torchrun's exit code, without the tracebacks it prints when it stops: a signal gives 128 + its number,
    failed ranks give 1 (their errors are in the per-rank error files, whose first line the launcher prints)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun_main()
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        report = e.format_msg()
        log = os.environ.get(TRAINER_LOG_ENV)
        try:
            if log:  # the launcher's trainer.log: the full report is kept, off the console
                with open(log, "a", encoding="utf-8", errors="replace") as f:
                    f.write(report + "\n")
            else:
                print(report, file=sys.stderr, flush=True)
        except OSError:  # a full disk: the launcher's summary names the rank's cause
            pass
        return 1
    except Exception as e:  # e.g. a rank's error file it cannot parse (half-written on a full disk)
        print(f"error: torchrun stopped on {type(e).__name__}: {first_line(e)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    main()
