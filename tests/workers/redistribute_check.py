"""torchrun worker: every DP rank's rollout groups are gathered and dealt back whole."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.rollout.distributed import redistribute


def main(out: str) -> None:
    init_default_process_group()
    rank = dist.get_rank()
    # Rank r holds 3 groups of 2 sequences; group g's rows carry id 100*r+g and lengths vary.
    rows, lens = [], []
    for g in range(3):
        for _ in range(2):
            rows.append(100 * rank + g)
            lens.append(3 + 2 * g + rank)
    seq_len = max(lens)
    mask = torch.arange(seq_len)[None, :] < torch.tensor(lens)[:, None]
    batch = {
        "input_ids": torch.tensor(rows)[:, None].expand(-1, seq_len) * mask,
        "attention_mask": mask,
        "rewards": torch.tensor(rows, dtype=torch.float32),
    }
    mine = redistribute(batch, granularity=2, group=None)
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        torch.save(gathered, out)
    destroy_process_groups()


if __name__ == "__main__":
    main(sys.argv[1])
