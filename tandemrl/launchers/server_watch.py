"""Wait for a trainer while watching the inference servers it uses.

A server that exits mid-run is reported at once on one line. The run goes on while a
server is left and weight updates can skip the dead one (``weight_update_mode=disk``);
otherwise the trainer is stopped and the trial fails with one line naming the dead
server(s), instead of waiting for the trainer's own timeouts. An auxiliary server (a judge) that
exits stops the run the same way: nothing else serves its model.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from tandemrl.utils.lifeline import exit_status


class WatchedServer(Protocol):
    """What is watched of a server: its process and its ``host:port``."""

    proc: subprocess.Popen
    address: str


def _notify(events: queue.Queue, key: object, proc: subprocess.Popen) -> None:
    threading.Thread(target=lambda: events.put((key, proc.wait())), daemon=True).start()


def wait_trainer(
    trainer: subprocess.Popen,
    servers: Sequence[WatchedServer],
    backend: str,
    survivable: bool,
    stop_trainer: Callable[[], None],
    aux: Sequence[tuple[str, WatchedServer]] = (),
) -> tuple[int, str | None]:
    """(trainer's exit code, None) or, when the servers can no longer serve the run, (1, one-line error).

    ``survivable``: the run can go on with fewer servers (disk weight updates).
    """
    events: queue.Queue = queue.Queue()
    _notify(events, None, trainer)
    for i, server in enumerate(servers):
        _notify(events, i, server.proc)
    for name, server in aux:
        _notify(events, (name, server.address), server.proc)
    dead: list[str] = []
    while True:
        key, rc = events.get()
        if key is None:
            return rc, None
        if isinstance(key, tuple):
            stop_trainer()
            return 1, f"auxiliary server {key[0]} at {key[1]} {exit_status(rc)}: the run needs it"
        server = servers[key]
        dead.append(f"{backend} server {server.address} {exit_status(rc)}")
        left = len(servers) - len(dead)
        print(f"[launcher] {dead[-1]}; {left} of {len(servers)} servers left", flush=True)
        if left == 0 or not survivable:
            why = "no server is left" if left == 0 else "weight_update_mode=collective needs every server"
            stop_trainer()
            return 1, f"{'; '.join(dead)}: {why}"
