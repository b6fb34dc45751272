"""Algorithms bound to the FSDP2 backend."""

from __future__ import annotations

from tandemrl.actors.binding import binds
from tandemrl.actors.lm import LMEngine
from tandemrl.actors.ppo import PPOActor, PPOCritic
from tandemrl.actors.reinforce import ReinforceActor
from tandemrl.engines.fsdp import FSDPEngine


@binds(LMEngine, attr="lm")
class FSDPLMEngine(FSDPEngine):
    """SFT on FSDP2: ``train_lm`` / ``evaluate_lm``."""


@binds(PPOActor, attr="actor")
class FSDPPPOActor(FSDPEngine):
    """PPO-family policy on FSDP2: ``compute_logp`` / ``compute_advantages`` / ``ppo_update``."""


@binds(PPOCritic, attr="critic")
class FSDPPPOCritic(FSDPEngine):
    """Value model on FSDP2 (config.is_critic=True): ``compute_values`` / ``ppo_update``."""


@binds(ReinforceActor, attr="actor")
class FSDPReinforceActor(FSDPEngine):
    """REINFORCE (e.g. ReMax rewards) on FSDP2: ``train_reinforce``."""
