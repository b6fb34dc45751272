"""Algorithms bound to the DeepSpeed ZeRO engine (the same algorithm classes as on FSDP2)."""

from __future__ import annotations

from tandemrl.actors.binding import binds
from tandemrl.actors.lm import LMEngine
from tandemrl.actors.ppo import PPOActor, PPOCritic
from tandemrl.actors.reinforce import ReinforceActor
from tandemrl.engines.deepspeed import DeepSpeedEngine


@binds(LMEngine, attr="lm")
class DeepSpeedLMEngine(DeepSpeedEngine):
    """SFT on DeepSpeed ZeRO: ``train_lm`` / ``evaluate_lm``."""


@binds(PPOActor, attr="actor")
class DeepSpeedPPOActor(DeepSpeedEngine):
    """PPO-family policy on DeepSpeed ZeRO: ``compute_logp`` / ``compute_advantages`` / ``ppo_update``."""


@binds(PPOCritic, attr="critic")
class DeepSpeedPPOCritic(DeepSpeedEngine):
    """Value model on DeepSpeed ZeRO (config.is_critic=True): ``compute_values`` / ``ppo_update``."""


@binds(ReinforceActor, attr="actor")
class DeepSpeedReinforceActor(DeepSpeedEngine):
    """REINFORCE (e.g. ReMax rewards) on DeepSpeed ZeRO: ``train_reinforce``."""
