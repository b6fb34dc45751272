"""Entry-point wrapper: bad user input ends the run with one clear line, not a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# Errors a user causes with a config value, a path or a data file. Their messages are
# written to name the offending field or file on one line.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)


def run_main(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """Run ``main(argv)``; a user-input error prints ``error: <one line>`` and exits 2.

    ``TANDEMRL_TRACEBACK=1`` re-raises instead, for debugging.
    """
    try:
        main(sys.argv[1:] if argv is None else argv)
    except USER_ERRORS as err:
        msg = str(err).strip("'\"")
        if os.environ.get("TANDEMRL_TRACEBACK") == "1" or "\n" in msg:
            raise
        print(f"error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
