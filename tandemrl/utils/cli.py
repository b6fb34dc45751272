"""Entry-point wrapper: bad user input ends the run with one clear line, not a traceback."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from tandemrl.utils.quiet import quiet_process

# Errors a user causes with a config value, a path or a data file. Their messages are
# written to name the offending field or file on one line.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)

# Set by the local launcher for torchrun and its ranks: the run's trainer.log, where torchrun's failure
# report (every failed rank's error with its traceback) is appended instead of printed.
TRAINER_LOG_ENV = "TANDEMRL_TRAINER_LOG"


def first_line(err: BaseException, *, with_type: bool = False, limit: int | None = None) -> str:
    """The first line of ``err``'s message (at most ``limit`` characters), or its type's name if it has none.

    ``with_type`` prefixes the type's name (``ValueError: ...``), for messages that wrap an unexpected error.
    """
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[0][:limit]
    return f"{type(err).__name__}: {line}" if with_type else line


def os_error_reason(err: OSError) -> str:
    """What the system said, with the errno's symbol: ``No space left on device (ENOSPC)``."""
    code = errno.errorcode.get(err.errno) if err.errno is not None else None
    return (err.strerror or first_line(err)) + (f" ({code})" if code else "")


def error_line(err: BaseException) -> str:
    """``<Type>: <one line>`` for a rank's ``error:`` line. An OSError from the system reads
    ``<Type>: PATH: <reason> (ERRNO)``, ``PATH -> PATH2`` for a two-path call (a rename), and names no
    path only when the error has none (see ``tandemrl.utils.files.names_file``)."""
    if not isinstance(err, OSError) or err.errno is None or not err.strerror:
        return first_line(err, with_type=True)
    paths = " -> ".join(_path_text(p) for p in (err.filename, err.filename2) if p is not None)
    return f"{type(err).__name__}: {paths + ': ' if paths else ''}{os_error_reason(err)}"


def _path_text(path: object) -> str:
    return os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose bad-argument error is one ``error:`` line naming the command (exit 2), not a usage block.

    ``--help`` still prints the full usage.
    """

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def interrupted_exit_code(err: KeyboardInterrupt) -> int:
    """The shell's code for a run stopped by a signal: 128 + its number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    return 128 + int(getattr(err, "signum", signal.SIGINT))


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise KeyboardInterrupt (``SignalInterrupt``), so teardown runs on any of them.

    SIGINT too: a process started in the background by a shell inherits SIGINT ignored, and Python then
    never turns it into KeyboardInterrupt; a launcher must stop on it wherever it was started.
    """

    def on_signal(signum: int, frame: object) -> None:
        raise SignalInterrupt(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def record_error(err: BaseException) -> None:
    """Write ``err`` to this rank's torchrun error file (``TORCHELASTIC_ERROR_FILE``), if there is one.

    torchrun then names it as the root cause, and the launchers print its first line last.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            ErrorHandler().record_exception(err)
        except OSError:  # a full disk: the error itself is printed either way; a half-written file would
            try:  # make torchrun fail reading it (a JSONDecodeError traceback instead of the cause)
                os.remove(path)
            except OSError:
                pass


def exit_with_error(err: BaseException, message: str | None = None) -> NoReturn:
    """Print ``error: <one line>``, record it for the launcher, and exit with status 2."""
    record_error(err)
    print(f"error: {message if message is not None else err}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def run_main(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """Run ``main(argv)``; a user-input error prints ``error: <one line>`` and exits 2.

    Any error is also recorded in torchrun's per-rank error file (see :func:`record_error`). Any other
    error is re-raised (its traceback printed), except on a rank the local launcher started: there the
    traceback is in the error file, which torchrun's report copies into trainer.log, so the rank prints
    ``error: <Type>: <one line>`` (``error_line``: an OSError names its file and errno) and exits 1.
    ``TANDEMRL_TRACEBACK=1`` re-raises always, for debugging.
    """
    quiet_process()
    try:
        main(sys.argv[1:] if argv is None else argv)
    except USER_ERRORS as err:
        msg = str(err).strip("'\"")
        if os.environ.get("TANDEMRL_TRACEBACK") == "1" or "\n" in msg:
            record_error(err)
            raise
        exit_with_error(err, msg)
    except Exception as err:
        record_error(err)
        log = os.environ.get(TRAINER_LOG_ENV)
        if log and os.environ.get("TORCHELASTIC_ERROR_FILE") and os.environ.get("TANDEMRL_TRACEBACK") != "1":
            print(f"error: {error_line(err)} (traceback in {log})", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise
