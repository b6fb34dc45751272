"""RL and SFT algorithms, each written once against the TrainEngine contract, so every backend runs it.

The functions re-exported here are pure tensor math (advantages, reward shaping, KL, policy and
value losses): plain tensors and numbers, no configs, no torch.distributed, tested on
hand-computed values. The algorithm classes compose them with an engine, e.g.
``PPOActor(config.actor, make_engine(backend, config.actor.engine))``: ``ppo`` (PPOActor,
PPOCritic, PPOBatch), ``reinforce`` (ReinforceActor), ``sft`` (SFTActor, supervised fine-tuning). This package
imports only ``tandemrl.api``, ``configs``, ``models`` and ``utils.stats_tracker``, never an engine.
"""

from tandemrl.algorithms.advantages import (
    batch_normalized_advantages,
    gae,
    group_normalized_advantages,
    leave_one_out_advantages,
    normalization_stats,
    normalize_advantages,
    remax_advantages,
)
from tandemrl.algorithms.aggregation import aggregate_loss, aggregation_weight
from tandemrl.algorithms.filters import reject_uniform_rewards
from tandemrl.algorithms.kl import kl_estimate, kl_penalty_rewards
from tandemrl.algorithms.offpolicy import (
    Correction,
    cispo_objective,
    correction_weights,
    mismatch_token_stats,
    resolve_correction,
    version_stats,
)
from tandemrl.algorithms.policy_loss import entropy_bonus, ppo_policy_loss, reinforce_loss
from tandemrl.algorithms.rewards import (
    apply_no_eos_penalty,
    overlong_penalty,
    place_at_last_token,
    response_ends_with_eos,
    shape_rewards,
)
from tandemrl.algorithms.value_loss import value_loss

__all__ = [
    "aggregate_loss",
    "aggregation_weight",
    "apply_no_eos_penalty",
    "batch_normalized_advantages",
    "cispo_objective",
    "Correction",
    "correction_weights",
    "entropy_bonus",
    "gae",
    "group_normalized_advantages",
    "kl_estimate",
    "kl_penalty_rewards",
    "leave_one_out_advantages",
    "mismatch_token_stats",
    "normalization_stats",
    "normalize_advantages",
    "overlong_penalty",
    "place_at_last_token",
    "ppo_policy_loss",
    "reinforce_loss",
    "reject_uniform_rewards",
    "remax_advantages",
    "resolve_correction",
    "response_ends_with_eos",
    "shape_rewards",
    "value_loss",
    "version_stats",
]
