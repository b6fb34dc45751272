"""Wait for a trainer while watching the inference servers it uses (the local launcher); the stall clock
that the Ray launcher's server actors and the Slurm job's server steps (``launchers.serve``) run too.

A server that exits mid-run is reported at once on one line. A server that lives but stops answering its
health route (hung, SIGSTOPped, swapping) is reported once after ``launcher.server_stall_warn`` seconds,
and the run stops after ``launcher.server_stall_limit`` seconds with that cause. The run goes on while a
server is left and weight updates can skip the dead one (``weight_update_mode=disk``);
otherwise the trainer is stopped and the trial fails with one line naming the dead
server(s), instead of waiting for the trainer's own timeouts. An auxiliary server (a judge) that
exits stops the run the same way: nothing else serves its model.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandemrl.utils.lifeline import exit_status


class WatchedServer(Protocol):
    """What is watched of a server: its process, its ``host:port`` and whether it answers."""

    proc: subprocess.Popen[Any]
    address: str

    def is_answering(self, timeout: float = 5.0) -> bool: ...


@dataclass
class StallBounds:
    """A live server that has not answered its health route for ``warn`` seconds is reported once; after
    ``limit`` seconds the run stops (``launcher.server_stall_warn`` / ``launcher.server_stall_limit``)."""

    warn: float = 60.0
    limit: float = 900.0

    @property
    def every(self) -> float:
        return max(0.5, min(5.0, self.warn / 3))


class StallClock:
    """One server's silence: feed it every health probe's answer; it says when to warn and when to stop.

    Shared by the local launcher (a thread here), the Ray launcher (each server's actor) and the Slurm job
    (``launchers.serve``), so a stalled server reads the same under every launcher.
    """

    def __init__(self, bounds: StallBounds, now: float | None = None) -> None:
        self.bounds = bounds
        self.last_ok = time.monotonic() if now is None else now
        self.warned = False

    def observe(self, answering: bool, now: float | None = None) -> tuple[str, float] | None:
        """("warn", silent seconds) once per silence past ``warn``; ("stop", silent seconds) past ``limit``, never
        before that silence's warning (a first probe already past the limit warns; the next one stops)."""
        now = time.monotonic() if now is None else now
        if answering:
            self.last_ok, self.warned = now, False
            return None
        silent = now - self.last_ok
        if silent > self.bounds.warn and not self.warned:
            self.warned = True
            return "warn", silent
        if silent > self.bounds.limit:
            return "stop", silent
        return None


def stall_warning(who: str, silent: float, bounds: StallBounds) -> str:
    """The one line about a server silent for ``silent`` seconds: which, since when, what waits on it."""
    since = time.strftime("%H:%M:%S", time.localtime(time.time() - silent))
    return (
        f"{who} has not answered for {silent:.0f}s (since {since}); the trainer's generation requests and weight "
        f"updates wait on it; the run stops after {bounds.limit:.0f}s (launcher.server_stall_limit)"
    )


def stall_cause(silent: float) -> str:
    """What happened to a server silent past the limit, without naming it (a failure record's "what")."""
    return f"has not answered for {silent:.0f}s (launcher.server_stall_limit)"


def stall_error(who: str, silent: float) -> str:
    """The run's one-line cause when a server stayed silent past the limit."""
    return f"{who} {stall_cause(silent)}: stopped"


def _watch_stalls(
    servers: Sequence[WatchedServer], backend: str, bounds: StallBounds, events: queue.Queue[Any], done: threading.Event
) -> None:
    """Probe every live server every ``bounds.every`` s; report a stall once, post ("stall", i) past the limit."""
    clocks = [StallClock(bounds) for _ in servers]
    while not done.wait(bounds.every):
        for i, server in enumerate(servers):
            if server.proc.poll() is not None:
                continue  # a dead server is the other watcher's
            event = clocks[i].observe(server.is_answering(timeout=min(5.0, bounds.every)))
            if event is None:
                continue
            what, silent = event
            if what == "stop":
                events.put((("stall", i), silent))
                return
            print(f"[launcher] {stall_warning(f'{backend} server {server.address}', silent, bounds)}", flush=True)


def _cause(server: WatchedServer) -> str:
    """`` (the first error its log names)``, or nothing: the summary line says what the crash was."""
    from tandemrl.inference.server import crash_cause

    log = getattr(server, "log_file", None)
    cause = crash_cause(log) if isinstance(log, str) else None
    return f" ({cause})" if cause else ""


def _notify(events: queue.Queue[Any], key: object, proc: subprocess.Popen[Any]) -> None:
    threading.Thread(target=lambda: events.put((key, proc.wait())), daemon=True).start()


def wait_trainer(
    trainer: subprocess.Popen[Any],
    servers: Sequence[WatchedServer],
    backend: str,
    survivable: bool,
    stop_trainer: Callable[[], None],
    aux: Sequence[tuple[str, WatchedServer]] = (),
    stalls: StallBounds | None = None,
) -> tuple[int, str | None]:
    """(trainer's exit code, None) or, when the servers can no longer serve the run, (1, one-line error).

    ``survivable``: the run can go on with fewer servers (disk weight updates). ``stalls``: the bounds on a
    live server that stops answering (none: not watched).
    """
    events: queue.Queue[Any] = queue.Queue()
    _notify(events, None, trainer)
    for i, server in enumerate(servers):
        _notify(events, i, server.proc)
    for name, server in aux:
        _notify(events, (name, server.address), server.proc)
    done = threading.Event()
    if stalls is not None and servers:
        threading.Thread(target=_watch_stalls, args=(servers, backend, stalls, events, done), daemon=True).start()
    try:
        return _wait_events(events, servers, backend, survivable, stop_trainer)
    finally:
        done.set()


def _wait_events(
    events: queue.Queue[Any],
    servers: Sequence[WatchedServer],
    backend: str,
    survivable: bool,
    stop_trainer: Callable[[], None],
) -> tuple[int, str | None]:
    dead: list[str] = []
    while True:
        key, rc = events.get()
        if key is None:
            return rc, None
        if isinstance(key, tuple) and key[0] == "stall":
            stop_trainer()
            return 1, stall_error(f"{backend} server {servers[key[1]].address}", rc)
        if isinstance(key, tuple):
            stop_trainer()
            return 1, f"auxiliary server {key[0]} at {key[1]} {exit_status(rc)}: the run needs it"
        server = servers[key]
        dead.append(f"{backend} server {server.address} {exit_status(rc)}{_cause(server)}")
        left = len(servers) - len(dead)
        print(f"[launcher] {dead[-1]}; {left} of {len(servers)} servers left", flush=True)
        if left == 0 or not survivable:
            why = "no server is left" if left == 0 else "weight_update_mode=collective needs every server"
            stop_trainer()
            return 1, f"{'; '.join(dead)}: {why}"
