"""Colocated turns on 2 gloo ranks: no rank computes while the servers are awake, and no rank moves
on from a turn while another rank's wake-up is still in flight."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from utils import free_port

from tandemrl.trainers.turns import TURNS_FILE, TurnTaker

SLOW_WAKE_S = 1.0  # rank 1's wake-up lags: rank 0 must still wait for it


def tick(counter: Any) -> int:
    """The next number of a counter both ranks share: the numbers order events across the processes."""
    with counter.get_lock():
        counter.value += 1
        return int(counter.value)


class RecordingSleeper:
    """A client whose sleep/wake_up calls are logged with their place in the shared order (rank 1 wakes slowly)."""

    def __init__(self, rank: int, counter: Any) -> None:
        self.rank, self.counter, self.events = rank, counter, []

    def sleep(self, level: int) -> None:
        self.events.append(("sleep", level, tick(self.counter)))

    def wake_up(self) -> None:
        if self.rank == 1:
            time.sleep(SLOW_WAKE_S)  # widens the window in which rank 0 could go on too early
        self.events.append(("woke", None, tick(self.counter)))


def _worker(rank: int, port: int, out_dir: str, counter: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        client = RecordingSleeper(rank, counter)
        turns = TurnTaker(client, colocated=True, log_dir=out_dir, sleep_level=0)
        marks = []
        for _ in range(2):
            with turns.trainer_turn():
                marks.append(("computed", tick(counter)))
            marks.append(("after", tick(counter)))  # e.g. rank 0 pushing weights (pause + collective)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"events": client.events, "marks": marks}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_no_rank_leaves_a_turn_before_every_wake_up_returned(tmp_path: Path) -> None:
    counter = mp.get_context("spawn").Value("q", 0)
    mp.spawn(_worker, args=(free_port(), str(tmp_path), counter), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for turn in range(2):
        slept = max(r["events"][2 * turn][2] for r in ranks)
        woke = max(r["events"][2 * turn + 1][2] for r in ranks)
        for r in ranks:
            computed, after = r["marks"][2 * turn][1], r["marks"][2 * turn + 1][1]
            assert slept < computed < woke < after, (turn, ranks)
    assert [r["events"][0][:2] for r in ranks] == [["sleep", 0]] * 2
    logged = [json.loads(line) for line in (tmp_path / TURNS_FILE).read_text().splitlines()]
    assert [t["turn"] for t in logged] == [1, 2]
