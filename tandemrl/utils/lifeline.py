"""Processes that must not outlive the process that started them.

Two tools, both Linux-first:

* ``die_with_parent()``: a torchrun rank asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``)
  to kill it the moment its torchrun agent dies, even by SIGKILL. The signal is sent in the
  agent's exit path, so a rank can start no system call (no write, no rename) once its
  agent is gone; at most a write already in progress completes. The death signal follows
  the *thread* that forked the rank, so it is armed only after checking that the agent's
  main thread did (``/proc/<ppid>/task/<ppid>/children``); otherwise, and off Linux, a
  watchdog thread polls ``os.getppid()`` and exits hard with one stderr line.
* ``python -I lifeline.py --parent PID -- CMD...`` (``lifeline_command``): a small supervisor for a
  child the launcher starts in its own session (an inference server, torchrun). It runs
  CMD in its process group, exits with CMD's status, forwards SIGTERM/SIGHUP to it, and
  when PID (the launcher) dies, stops the whole group: SIGTERM, then SIGKILL after
  ``--grace`` seconds. vLLM's engine-core processes survive a SIGKILLed API server, so
  only signalling the group leaves nothing behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def _lost_parent(what: str, parent: int) -> None:
    print(f"error: {what}: parent process {parent} is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _spawned_by_main_thread(parent: int) -> bool:
    """Whether ``parent``'s main thread forked us (the death signal then fires only when it exits)."""
    try:
        with open(f"/proc/{parent}/task/{parent}/children") as f:
            return str(os.getpid()) in f.read().split()
    except OSError:
        return False


def _watch(parent: int, what: str) -> None:
    def run() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        _lost_parent(what, parent)

    threading.Thread(target=run, name="tandemrl-lifeline", daemon=True).start()


def die_with_parent(what: str) -> str:
    """Make this process end when its parent does; returns how ("pdeathsig" or "watchdog").

    Call once, early: a parent that died before the call is caught only if we were
    re-parented to init (pid 1); a subreaper parent in between is not detected.
    """
    parent = os.getppid()
    if parent == 1:
        _lost_parent(what, parent)
    if sys.platform.startswith("linux") and _spawned_by_main_thread(parent):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # died between the two calls
                _lost_parent(what, parent)
            return "pdeathsig"
    _watch(parent, what)
    return "watchdog"


def lifeline_command(cmd: list[str], parent: int | None = None, grace: float = 20.0) -> list[str]:
    """``cmd`` wrapped in the supervisor, bound to ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    # -I: the supervisor needs only the standard library; CMD still gets the environment unchanged.
    return [sys.executable, "-I", os.path.abspath(__file__), "--parent", str(parent), "--grace", str(grace), "--", *cmd]


def exit_status(rc: int) -> str:
    """``exited with 1`` / ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with {rc}"


def _stop_group(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM our whole process group (not us), SIGKILL it after ``grace``; never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the rest of the group (the child's children), and us
    os._exit(1)


def supervise(parent: int, cmd: list[str], grace: float) -> int:
    """Run ``cmd`` until it exits (its status is returned) or ``parent`` dies (the group is stopped)."""
    if os.getppid() != parent:
        _lost_parent(cmd[0], parent)
    child = subprocess.Popen(cmd)

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the launcher, which stops us
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:
            print(f"[lifeline] launcher (pid {parent}) is gone: stopping {' '.join(cmd[:3])} ...", file=sys.stderr)
            _stop_group(child, grace)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lifeline.py", description=__doc__.splitlines()[0])
    p.add_argument("--parent", type=int, required=True, help="pid whose death stops CMD's process group")
    p.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given after --")
    rc = supervise(args.parent, cmd, args.grace)
    if rc < 0:  # killed by a signal: end the same way, so our parent sees the same status
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    raise SystemExit(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
