"""Colocated placement (``|`` in ``allocation_mode``): the servers and the trainer take turns.

When an inference component shares its devices with the trainer (``vllm:d1|fsdp:d1``), training
runs synchronously and each ``train_step`` is the trainer's turn: every trainer rank first puts the
servers to sleep through its client (generation paused; on GPU, sleep level 1 also frees the KV
cache and offloads the weights, so training gets the memory), the ranks meet at a barrier, the
step runs, the ranks meet again, the servers wake up and the ranks meet once more. Weight pushes, evaluation and the next
rollout happen in the servers' turn. On CPU, asleep means the server's threads wait, so the
trainer's threads (the launcher gives them every core) have the machine to themselves.

Rank 0 appends each trainer turn, as wall-clock ``[start, end]`` seconds, to ``<log_dir>/turns.jsonl``;
together with the servers' request log (``tandemrl.inference.request_log``) that shows no
generation ran during a turn.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist

from tandemrl.utils.files import append_text

TURNS_FILE = "turns.jsonl"


class Sleeper(Protocol):
    """The client calls a turn needs (``RemoteInferenceClient`` has them)."""

    def sleep(self, level: int) -> None: ...

    def wake_up(self) -> None: ...


def default_sleep_level() -> int:
    """1 (free device memory) when training on GPU; 0 (stop generating) on CPU, where nothing is freed."""
    return 1 if torch.cuda.is_available() else 0


class TurnTaker:
    """Brackets the trainer's compute with server sleep/wake when ``colocated``; otherwise does nothing."""

    def __init__(self, client: Sleeper, colocated: bool, log_dir: str | None = None, sleep_level: int | None = None):
        self.client = client
        self.colocated = colocated
        self.sleep_level = default_sleep_level() if sleep_level is None else sleep_level
        self._log = os.path.join(log_dir, TURNS_FILE) if log_dir and colocated else None
        self.turns = 0

    @contextmanager
    def trainer_turn(self) -> Iterator[None]:
        """Servers asleep on entry (on every rank), awake after exit. Not entered again on an exception."""
        if not self.colocated:
            yield
            return
        self.client.sleep(self.sleep_level)
        _barrier()  # no rank computes before every rank's client has paused the servers
        start = time.time()
        yield
        end = time.time()
        # Also the closing barrier: no rank wakes the servers while another still computes. The
        # turn spans every rank's compute, and each rank took its times between the barriers, so
        # every pause ended before ``start`` and every wake-up starts after ``end``.
        start, end = _span_over_ranks(start, end)
        self.client.wake_up()
        # Every rank's wake-up has returned before any rank goes on. Rank 0 goes on to push weights,
        # which pauses the servers and runs a collective with every rank; a wake-up still in flight
        # would queue on the server behind that update while its rank never joins the collective.
        _barrier()
        self.turns += 1
        if self._log is not None and _rank() == 0:
            append_text(self._log, json.dumps({"turn": self.turns, "start": start, "end": end}) + "\n")


def _span_over_ranks(start: float, end: float) -> tuple[float, float]:
    """(earliest start, latest end) over all ranks: one all-reduce, which is also a barrier."""
    if not (dist.is_available() and dist.is_initialized()):
        return start, end
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    span = torch.tensor([-start, end], dtype=torch.float64, device=device)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    return -float(span[0]), float(span[1])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
