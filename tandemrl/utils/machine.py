"""Where and when a figure was measured: the line every benchmark prints at its start and its end.

A published number is only reproducible with its machine and its load, so each bench script wraps its
`main()` in `measured_on()`, which prints the UTC time, the CPU model, the cores this process may use and
the load average, once before the run and once after it (rank 0 only under torchrun).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
from collections.abc import Iterator


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    break  # the first processor's block ends at a blank line
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    bf16 = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in fields.get("flags", "").split()]
    return name + (f" with {'+'.join(bf16)}" if bf16 else "")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which can be fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gpu() -> str:
    torch = sys.modules.get("torch")  # never import torch just to describe the machine
    if torch is None or not torch.cuda.is_available():
        return ""
    return f", GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"


def machine_line(now: datetime.datetime | None = None) -> str:
    """One line: UTC time, CPU model, usable/total cores, any GPU torch sees, load average (1/5/15 min)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    load = "/".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{now:%Y-%m-%d %H:%M} UTC, {cpu_model()}, {usable_cores()} of {os.cpu_count()} cores{_gpu()}, "
        f"load average {load}"
    )


@contextlib.contextmanager
def measured_on(name: str) -> Iterator[None]:
    """Print `name` with `machine_line()` before and after the block (rank 0 only), even if it fails.

    The block runs quiet like our training scripts (`quiet_process`; `TANDEMRL_VERBOSE=1` keeps the noise).
    """
    from tandemrl.utils.quiet import quiet_process

    quiet_process()
    show = os.environ.get("RANK", "0") == "0"
    if show:
        print(f"[{name}] start: {machine_line()}", flush=True)
    try:
        yield
    finally:
        if show:
            print(f"[{name}] end: {machine_line()}", flush=True)
