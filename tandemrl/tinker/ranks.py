"""Training calls of ``tandemrl tinker-serve`` on every rank of a torchrun world.

Rank 0 serves the API; its training worker runs each call as ``ranks.run("optim_step", model_id, adam)``,
which first sends the call's name and arguments to every other rank (one broadcast on the trainer's
CPU group), then runs it on rank 0. The other ranks run ``follow(trainer)``: receive a call, run it,
until ``ranks.stop()``. Every ``EngineTrainer`` method is collective and deterministic given its
arguments, so the ranks stay in step; the API checks a request before it becomes a call. A call that
raises on a follower is logged there (rank 0 raises the same error to the client).

    trainer = EngineTrainer(model_dir, max_rank)          # every rank: joins the world, builds the engine
    if trainer.rank != 0:
        follow(trainer)                                   # until rank 0 stops
    else:
        ranks = Ranks(trainer)                            # tinker-serve's calls go through ranks.run
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from tandemrl.tinker.trainer import EngineTrainer

logger = logging.getLogger(__name__)
STOP = "stop"


def _receive(trainer: EngineTrainer) -> tuple[str, tuple[Any, ...]]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=trainer.object_group)
    name, args = box[0]
    return str(name), tuple(args)


class Ranks:
    """Rank 0's side: ``run`` sends a call to the followers, then makes it here (see the module docstring)."""

    def __init__(self, trainer: EngineTrainer) -> None:
        if trainer.rank != 0:
            raise RuntimeError(f"Ranks: rank {trainer.rank} follows (tandemrl.tinker.ranks.follow); only rank 0 runs")
        self.trainer = trainer

    def run(self, name: str, *args: Any) -> Any:
        if not hasattr(self.trainer, name) or name.startswith("_") or name == STOP:
            raise AttributeError(f"EngineTrainer has no training call {name!r}")
        if self.trainer.world > 1:
            dist.broadcast_object_list([(name, args)], src=0, group=self.trainer.object_group)
        return getattr(self.trainer, name)(*args)

    def stop(self) -> None:
        """Tell the followers to return (a world of one: nothing to do)."""
        if self.trainer.world > 1:
            dist.broadcast_object_list([(STOP, ())], src=0, group=self.trainer.object_group)


def follow(trainer: EngineTrainer) -> int:
    """Run rank 0's calls on this rank until it stops; the number of calls run."""
    calls = 0
    while True:
        name, args = _receive(trainer)
        if name == STOP:
            return calls
        calls += 1
        try:
            getattr(trainer, name)(*args)
        except Exception as err:  # noqa: BLE001 - rank 0 reports it to the client
            logger.warning("tinker-serve rank %d: call %s failed: %s", trainer.rank, name, err)
