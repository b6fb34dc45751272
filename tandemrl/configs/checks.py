"""Checks of a whole experiment config, beyond what one field's type, ``choices`` or ``min`` can say.

``first_problem(config)`` finds values that are each valid but do not fit together (a batch that
does not split over the data-parallel ranks or into whole groups); ``load_config`` reports it as
one line naming the key and where it was set.

``check_inputs(config)`` looks at what a config points to: model directories and dataset files.
The launchers run it before starting any server or trainer, by running the training script with
``TANDEMRL_CHECK_ONLY=1``: ``load_config`` raises :class:`InputsChecked` instead of returning, so the
script stops before doing any work; the script's entry point checks the inputs on the way out
(``tandemrl.trainers.entry``; see ``tandemrl.launchers.check``).
"""

from __future__ import annotations

import os
from typing import Any

from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.configs.rollout import GenerationHyperparameters

CHECK_ONLY_ENV = "TANDEMRL_CHECK_ONLY"

# (dotted key, what is wrong with its value): the loader adds the key's source.
Problem = tuple[str, str]

_DATASET_KEYS = ("train_dataset", "valid_dataset")


def check_only() -> bool:
    """True in a check-only run (``TANDEMRL_CHECK_ONLY=1``); :func:`load_config` then counts its calls."""
    return os.environ.get(CHECK_ONLY_ENV) == "1"


# How many configs load_config started building in this check-only process.
configs_seen = [0]


class InputsChecked(BaseException):
    """Raised by ``load_config`` in check-only mode once the config is fine; carries the config.

    ``tandemrl.trainers.entry.load_script_config`` catches it, checks the model paths and data
    files the config names, and raises it again, so the script stops before doing any work.
    """

    def __init__(self, config_path: str, config: Any = None) -> None:
        super().__init__(config_path)
        self.config = config


def _data_parallel_size(config: Any) -> tuple[int | None, Problem | None]:
    mode = getattr(config, "allocation_mode", None)
    if not isinstance(mode, str):
        return None, None
    from tandemrl.api.allocation import AllocationMode

    try:
        alloc = AllocationMode.from_str(mode)
    except ValueError as err:
        return None, ("allocation_mode", f"is invalid: {str(err).splitlines()[0]}")
    if alloc.train is None:
        return None, ("allocation_mode", f"'{mode}' has no training component")
    return alloc.train.strategy.dp, None


def _batch_splits(config: Any, dp: int) -> Problem | None:
    for key in _DATASET_KEYS:
        ds = getattr(config, key, None)
        if isinstance(ds, DatasetConfig) and ds.batch_size % dp:
            return (
                f"{key}.batch_size",
                f"must be a multiple of {dp}, the data-parallel size of allocation_mode "
                f"'{config.allocation_mode}', got {ds.batch_size}",
            )
    return None


def _groups_fit(config: Any, dp: int) -> Problem | None:
    """Each rank's rollout batch must hold whole groups, and enough of them for the minibatches."""
    gconfig, train = getattr(config, "gconfig", None), getattr(config, "train_dataset", None)
    if not isinstance(gconfig, GenerationHyperparameters) or not isinstance(train, DatasetConfig):
        return None
    per_rank = train.batch_size // dp * gconfig.n_samples
    for key in ("actor", "critic"):
        cfg = getattr(config, key, None)
        if not isinstance(cfg, (PPOActorConfig, PPOCriticConfig)):
            continue
        if isinstance(cfg, PPOActorConfig) and cfg.group_size == 1 and "group" in _norm_levels(cfg):
            return f"{key}.group_size", "must be > 1 when adv_norm uses group-level statistics (level: group)"
        if per_rank % cfg.group_size:
            return (
                f"{key}.group_size",
                f"must divide each rank's batch of {per_rank} sequences, got {cfg.group_size} "
                f"(train_dataset.batch_size={train.batch_size} / {dp} data-parallel ranks "
                f"x gconfig.n_samples={gconfig.n_samples})",
            )
        if cfg.ppo_n_minibatches > per_rank // cfg.group_size:
            return (
                f"{key}.ppo_n_minibatches",
                f"must be at most the {per_rank // cfg.group_size} groups of group_size={cfg.group_size} "
                f"in each rank's batch of {per_rank} sequences, got {cfg.ppo_n_minibatches}",
            )
    return None


def _norm_levels(cfg: PPOActorConfig) -> tuple[str, str]:
    return cfg.adv_norm.mean_level, cfg.adv_norm.std_level


def _turns_fit(config: Any) -> Problem | None:
    """Colocated servers and trainer take turns, so they cannot overlap (async)."""
    if getattr(config, "async_training", False) is not True:
        return None
    from tandemrl.api.allocation import AllocationMode

    alloc = AllocationMode.from_str(config.allocation_mode)
    if alloc.gen is not None and alloc.train is not None and alloc.colocated(alloc.gen, alloc.train):
        return (
            "async_training",
            f"must be false when allocation_mode '{config.allocation_mode}' colocates the servers and the "
            "trainer ('|': they take turns on the same devices); or place them apart with '+'",
        )
    return None


def first_problem(config: Any) -> Problem | None:
    """The first pair of values that do not fit together, or None."""
    dp, problem = _data_parallel_size(config)
    if problem is not None or dp is None:
        return problem
    return _batch_splits(config, dp) or _groups_fit(config, dp) or _turns_fit(config)
