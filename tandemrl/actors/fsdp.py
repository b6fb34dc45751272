"""Algorithms bound to the FSDP2 backend."""

from __future__ import annotations

from tandemrl.actors.binding import binds
from tandemrl.actors.lm import LMEngine
from tandemrl.engines.fsdp import FSDPEngine


@binds(LMEngine, attr="lm")
class FSDPLMEngine(FSDPEngine):
    """SFT on FSDP2: ``train_lm`` / ``evaluate_lm``."""
