"""Algorithms bound to the Megatron-core engine (the same algorithm classes as on FSDP2)."""

from __future__ import annotations

from tandemrl.actors.binding import binds
from tandemrl.actors.lm import LMEngine
from tandemrl.actors.ppo import PPOActor, PPOCritic
from tandemrl.actors.reinforce import ReinforceActor
from tandemrl.engines.megatron.engine import MegatronEngine


@binds(LMEngine, attr="lm")
class MegatronLMEngine(MegatronEngine):
    """SFT on Megatron (TP/PP/DP/EP): ``train_lm`` / ``evaluate_lm``."""


@binds(PPOActor, attr="actor")
class MegatronPPOActor(MegatronEngine):
    """PPO-family policy on Megatron: ``compute_logp`` / ``compute_advantages`` / ``ppo_update``."""


@binds(PPOCritic, attr="critic")
class MegatronPPOCritic(MegatronEngine):
    """Value model on Megatron (config.is_critic=True): ``compute_values`` / ``ppo_update``."""


@binds(ReinforceActor, attr="actor")
class MegatronReinforceActor(MegatronEngine):
    """REINFORCE (e.g. ReMax rewards) on Megatron: ``train_reinforce``."""
