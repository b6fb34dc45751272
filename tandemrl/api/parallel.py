"""How many ways each parallel dimension of one component splits; imports no torch (the configs read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelStrategy:
    """Sizes of each parallel dimension of one component (training or inference)."""

    dp: int = 1  # data parallel (FSDP/ZeRO shards over it)
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel (MoE); shares devices with dp*cp*tp
    etp: int = 1  # expert tensor parallel (MoE)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp
