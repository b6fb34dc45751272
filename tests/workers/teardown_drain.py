"""torchrun worker (2 ranks): rank 1 starts an all-reduce it never waits for and tears down at once;
rank 0 joins that all-reduce only after rank 1 has started its teardown (a marker file). Rank 1
also keeps a reference to the group, as DeepSpeed and Megatron do, so destroying the group cannot be
what waits for the collective: the teardown's drain must. Each rank writes what it saw to ``out``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.teardown import destroy_process_groups

KEPT: list[dist.ProcessGroup] = []


def wait_for(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def main(marker: str, out: str) -> None:
    init_default_process_group()
    dist.barrier()  # the group is up on both ranks
    rank = dist.get_rank()
    if rank == 1:
        KEPT.append(dist.group.WORLD)  # a library's module-level reference that no releaser knows
        t = torch.full((1024,), 2.0)
        work = dist.all_reduce(t, async_op=True)  # never waited on, like a ZeRO-3 prefetch
        with open(marker, "w", encoding="utf-8"):
            pass
        destroy_process_groups()
        seen = {"completed": work.is_completed()}
    else:
        wait_for(marker)
        t = torch.full((1024,), 1.0)
        dist.all_reduce(t)
        destroy_process_groups()
        seen = {"sum": float(t[0])}
    with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
