"""Process-group teardown that finishes while the interpreter is still alive.

``dist.destroy_process_group()`` unregisters every group, but a gloo group's C++ object (and its
two ``pt_gloo_runloop`` worker threads) lives on while Python still references it, and DeepSpeed
and Megatron keep groups in module globals. Such a group is then only freed during interpreter
shutdown. If one of its workers is finishing a collective at that moment, dropping the work's
tensors needs the GIL, which a finalizing interpreter no longer hands out: the thread is forced
to exit inside a C++ destructor and the process aborts with ``terminate called without an active
exception`` (SIGABRT). Whether that happens depends on which rank exits first and how busy the
machine is, so it showed up as a rare crash of otherwise finished runs.

:func:`destroy_process_groups` waits for every collective in flight, destroys the groups, drops
the references libraries keep (backends register a releaser), collects them so their workers are
joined now, and reports any worker thread still alive (some references live in C++ where no
releaser reaches; draining first makes those groups idle, so nothing runs in them at shutdown).
"""

from __future__ import annotations

import gc
import logging
import os
import types
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

_RELEASERS: list[Callable[[], None]] = []
GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives each gloo worker thread


def register_group_releaser(release: Callable[[], None]) -> None:
    """Run ``release()`` at teardown: it drops the process groups a library keeps in its globals."""
    if release not in _RELEASERS:
        _RELEASERS.append(release)


def drop_module_groups(module: types.ModuleType) -> None:
    """Forget every process group ``module`` holds in a global, directly or in a dict."""
    for name, value in list(vars(module).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(module, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


def gloo_worker_threads() -> int:
    """Live gloo worker threads of this process (0 where /proc is unavailable)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended while we looked
            continue
    return count


def _drain_groups() -> None:
    """Wait until every collective already issued on any group has finished, on every rank.

    A gloo barrier completes only after all earlier work of its group; without it an asynchronous
    collective nobody waited on (ZeRO-3 prefetches) finishes whenever the slowest rank catches up,
    possibly while this rank's interpreter is already shutting down. Groups are visited in creation
    order, the same on every rank, so the barriers cannot deadlock.
    """
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        dist.barrier(group=group)


def destroy_process_groups() -> int:
    """Destroy every process group and join its workers now; returns the gloo workers left (0 when clean).

    Call it once at the end of a process, after the engines' ``destroy()``; a leftover worker means
    some object still references a group (logged at debug level).
    """
    if dist.is_initialized():
        _drain_groups()
        dist.destroy_process_group()
    for release in _RELEASERS:
        release()
    gc.collect()
    left = gloo_worker_threads()
    if left:
        # Expected after training: some references live in C++ where no releaser reaches; drained, idle.
        logger.debug("%d gloo worker threads outlived destroy_process_groups(): a group is still referenced", left)
    return left
