"""Config of a PPO-family actor or critic (GRPO, DAPO, RLOO, ... are presets of it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandemrl.configs.engine import TrainEngineConfig


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """A policy trained with a PPO-style objective."""

    group_size: int = field(default=1, metadata={"help": "Samples per prompt (GRPO group)."})
    ppo_n_minibatches: int = field(default=1, metadata={"help": "Minibatches per PPO epoch."})
    ppo_n_epochs: int = field(default=1, metadata={"help": "Passes over each batch."})
    eps_clip: float = field(default=0.2, metadata={"help": "Lower (and default upper) ratio clip."})
    eps_clip_higher: float | None = field(default=None, metadata={"help": "Upper ratio clip (DAPO clip-higher)."})
    c_clip: float | None = field(default=None, metadata={"help": "Dual-clip bound (> 1) for negative advantages."})
    temperature: float = field(default=1.0, metadata={"help": "Logits are divided by this (match the sampler)."})
    kl_ctl: float = field(default=0.0, metadata={"help": "KL coefficient against the reference policy."})
    reward_scaling: float = field(default=1.0, metadata={"help": "Multiply rewards."})
    reward_bias: float = field(default=0.0, metadata={"help": "Add to rewards."})
    reward_clip: float = field(default=20.0, metadata={"help": "Clip rewards to [-x, x]."})
    discount: float = field(default=1.0, metadata={"help": "GAE gamma."})
    gae_lambda: float = field(default=1.0, metadata={"help": "GAE lambda."})
    recompute_logprob: bool = field(default=True, metadata={"help": "Recompute proximal logprobs before update."})
    use_decoupled_loss: bool = field(default=False, metadata={"help": "Decoupled PPO with behaviour weights."})
    behav_imp_weight_cap: float | None = field(default=None, metadata={"help": "Cap of behaviour importance weight."})
