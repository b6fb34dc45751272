"""Checks of a whole experiment config, beyond what one field's type, ``choices`` or ``min`` can say.

``first_problem(config)`` finds values that are each valid but do not fit together (a batch that
does not split over the data-parallel ranks, into whole groups or micro-batches; group statistics
over one sample; async training that cannot overlap; stale samples nothing corrects; truncated
sampling whose ratios would be biased); ``load_config`` reports it as one line naming the key and
where it was set. The list is in docs/concepts.md (Config guards).

``check_inputs(config)`` looks at what a config points to: model directories and dataset files.
The launchers run it before starting any server or trainer, by running the training script with
``TANDEMRL_CHECK_ONLY=1``: ``load_config`` raises :class:`InputsChecked` instead of returning, so the
script stops before doing any work; the script's entry point checks the inputs on the way out
(``tandemrl.trainers.entry``; see ``tandemrl.launchers.check``).
"""

from __future__ import annotations

import os
from typing import Any

from tandemrl.api.allocation import AllocationMode
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.experiment import async_enabled
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


def allocation_problem(config: Any) -> Problem | None:
    """Why ``config.allocation_mode`` does not parse against the backend rows (``configs.backends``), or None
    (also for a config without that key)."""
    mode = getattr(config, "allocation_mode", None)
    if not isinstance(mode, str):
        return None
    try:
        parse_allocation(mode)
    except ValueError as err:
        return ("allocation_mode", f"is invalid: {str(err).splitlines()[0]}")
    return None


def _allocation(config: Any) -> AllocationMode:
    """``config.allocation_mode`` parsed (first_problem checks it parses before any check reads it)."""
    return parse_allocation(config.allocation_mode)


def _data_parallel_size(config: Any) -> tuple[int | None, Problem | None]:
    if not isinstance(getattr(config, "allocation_mode", None), str):
        return None, None
    alloc = _allocation(config)
    if alloc.train is None:
        return None, ("allocation_mode", f"'{alloc.spec}' has no training component")
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
            return (
                f"{key}.group_size",
                f"must be > 1 when {key}.adv_norm.mean_level or std_level is 'group' (statistics over a group "
                "of one sample: its advantage is 0 or its std undefined); set it to gconfig.n_samples",
            )
        if isinstance(cfg, PPOActorConfig) and cfg.dynamic_sampling and cfg.group_size == 1:
            return (
                f"{key}.dynamic_sampling",
                "needs group_size > 1: a group of one sample always has uniform rewards and would never be accepted",
            )
        if per_rank % cfg.group_size:
            return (
                f"{key}.group_size",
                f"must divide each rank's batch of {per_rank} sequences, got {cfg.group_size} "
                f"(train_dataset.batch_size={train.batch_size} / {dp} data-parallel ranks "
                f"x gconfig.n_samples={gconfig.n_samples})",
            )
        groups = per_rank // cfg.group_size
        if cfg.ppo_n_minibatches > groups or groups % cfg.ppo_n_minibatches:
            return (
                f"{key}.ppo_n_minibatches",
                f"must divide the {groups} groups of group_size={cfg.group_size} in each rank's batch of "
                f"{per_rank} sequences into equal minibatches, got {cfg.ppo_n_minibatches}",
            )
    return None


def _samples_fill_a_batch(config: Any) -> Problem | None:
    """With drop_last, fewer rows than one batch leave no batch at all."""
    for key in _DATASET_KEYS:
        ds = getattr(config, key, None)
        if isinstance(ds, DatasetConfig) and ds.drop_last and ds.max_samples is not None:
            if ds.max_samples < ds.batch_size:
                return (
                    f"{key}.max_samples",
                    f"must be at least {key}.batch_size={ds.batch_size} when {key}.drop_last is true "
                    f"(no whole batch would remain), got {ds.max_samples}",
                )
    return None


# Train engine configs whose micro-batches hold the training sequences.
_ENGINE_KEYS = ("actor.engine", "critic.engine", "ref", "model")


def _micro_batches_fit(config: Any) -> Problem | None:
    """A token budget per micro-batch must hold the longest sequence the data and sampler allow."""
    train = getattr(config, "train_dataset", None)
    if not isinstance(train, DatasetConfig) or train.max_length is None:
        return None
    longest, why = train.max_length, f"train_dataset.max_length={train.max_length}"
    gconfig = getattr(config, "gconfig", None)
    if train.type == "rl" and isinstance(gconfig, GenerationHyperparameters):
        longest += gconfig.max_new_tokens
        why += f" + gconfig.max_new_tokens={gconfig.max_new_tokens}"
    for key in _ENGINE_KEYS:
        engine = config
        for part in key.split("."):
            engine = getattr(engine, part, None)
        budget = getattr(getattr(engine, "mb_spec", None), "max_tokens_per_mb", None)
        if isinstance(budget, int) and budget < longest:
            return (
                f"{key}.mb_spec.max_tokens_per_mb",
                f"must hold one whole sequence of up to {longest} tokens ({why}), got {budget}",
            )
    return None


def _norm_levels(cfg: PPOActorConfig) -> tuple[str, str]:
    return cfg.adv_norm.mean_level, cfg.adv_norm.std_level


def _turns_fit(config: Any) -> Problem | None:
    """Colocated servers and trainer take turns, so they cannot overlap (async)."""
    if not async_enabled(config):
        return None
    alloc = _allocation(config)
    if alloc.gen is not None and alloc.train is not None and alloc.colocated(alloc.gen, alloc.train):
        return (
            "async_training",
            f"must be false when allocation_mode '{config.allocation_mode}' colocates the servers and the "
            "trainer ('|': they take turns on the same devices); or place them apart with '+'",
        )
    return None


def _staleness(config: Any) -> int | None:
    """Versions a sample may lag the trainer when training is async, else None (sync or not RL)."""
    if not async_enabled(config):
        return None
    return getattr(getattr(config, "rollout", None), "max_head_offpolicyness", None)


def _async_overlaps(config: Any) -> Problem | None:
    """async_training=true with staleness 0 would run synchronously."""
    if getattr(config, "async_training", None) is True and _staleness(config) == 0:
        return (
            "async_training",
            "must be false when rollout.max_head_offpolicyness is 0: no sample may come from older weights than "
            "the trainer's, so rollout never overlaps training; or set rollout.max_head_offpolicyness >= 1",
        )
    return None


def _truncation(gconfig: GenerationHyperparameters) -> tuple[str, object] | None:
    """The first sampling field that keeps only part of the vocabulary, with its value."""
    if gconfig.greedy:
        return None
    for name, value, truncates in (
        ("top_p", gconfig.top_p, gconfig.top_p < 1.0),
        ("top_k", gconfig.top_k, gconfig.top_k > 0),
        ("min_p", gconfig.min_p, gconfig.min_p > 0.0),
    ):
        if truncates:
            return name, value
    return None


def _replay_differs(actor: PPOActorConfig, gconfig: GenerationHyperparameters) -> Problem | None:
    """The replay must use the sampler's settings (each compared as the filter it means: off is off)."""
    sampled = {
        "top_k": max(gconfig.top_k, 0) if not gconfig.greedy else 0,
        "top_p": min(gconfig.top_p, 1.0) if not gconfig.greedy else 1.0,
        "min_p": max(gconfig.min_p, 0.0) if not gconfig.greedy else 0.0,
    }
    replayed = {"top_k": max(actor.top_k, 0), "top_p": min(actor.top_p, 1.0), "min_p": max(actor.min_p, 0.0)}
    for name, value in sampled.items():
        if replayed[name] != value:
            return (
                f"actor.{name}",
                f"is {getattr(actor, name)} but gconfig.{name} is {getattr(gconfig, name)}: actor.truncation_replay "
                f"replays the sampler's truncation, so set actor.{name}: ${{gconfig.{name}}}",
            )
    return None


def _truncation_replayed(config: Any) -> Problem | None:
    """Ratios under top-p/top-k/min-p sampling are biased unless the trainer replays the truncation."""
    actor, gconfig = getattr(config, "actor", None), getattr(config, "gconfig", None)
    if not isinstance(actor, PPOActorConfig) or not isinstance(gconfig, GenerationHyperparameters):
        return None
    if actor.truncation_replay:
        return _replay_differs(actor, gconfig)
    truncated = _truncation(gconfig)
    if truncated is None:
        return None
    name, value = truncated
    return (
        f"gconfig.{name}",
        f"is {value}: truncated sampling (gconfig.top_p < 1, gconfig.top_k > 0 or gconfig.min_p > 0) makes the "
        "server's logprobs renormalised over the kept tokens while the trainer's span the vocabulary, biasing "
        "every importance ratio, and actor.truncation_replay is false; set actor.truncation_replay=true (with "
        "actor.top_p/top_k/min_p equal to gconfig's), or sample with top_p=1, top_k=-1, min_p=0",
    )


def _engine_configs(config: Any) -> list[tuple[str, Any]]:
    """(key, TrainEngineConfig) of every engine a run builds: ``model``, ``actor.engine``, ``critic.engine``..."""
    from dataclasses import fields, is_dataclass

    from tandemrl.configs.engine import TrainEngineConfig

    out = []
    for f in fields(config) if is_dataclass(config) else ():
        cfg, key = getattr(config, f.name), f.name
        if isinstance(getattr(cfg, "engine", None), TrainEngineConfig):  # actor.engine, critic.engine
            cfg, key = cfg.engine, f"{key}.engine"
        if isinstance(cfg, TrainEngineConfig):
            out.append((key, cfg))
    return out


def _router_replay_fits(config: Any) -> Problem | None:
    """MoE routing replay is implemented on the Megatron engine only (docs/moe.md)."""
    train = _allocation(config).train
    backend = train.backend if train else None
    for key, cfg in _engine_configs(config):
        if cfg.megatron.router_replay and (train is None or "router_replay" not in train.features):
            return (
                f"{key}.megatron.router_replay",
                f"is true: MoE routing replay is Megatron-only, but allocation_mode '{config.allocation_mode}' "
                f"trains with {backend}",
            )
    return None


def _addresses_valid(config: Any) -> Problem | None:
    """Every running server a config names (``rollout.server_addrs``, a teacher's) is ``host:port``: a bad one is
    one line here, not a trainer started against it."""
    from dataclasses import fields, is_dataclass

    from tandemrl.api.net import address_problem

    for f in fields(config) if is_dataclass(config) else ():
        for addr in getattr(getattr(config, f.name), "server_addrs", None) or ():
            problem = address_problem(addr)
            if problem is not None:
                return f"{f.name}.server_addrs", f"holds '{addr}', which {problem}"
    return None


def _head_dtype_fits(config: Any) -> Problem | None:
    """An fp32 output head: FSDP2 and DeepSpeed compute one; a critic has none."""
    train = _allocation(config).train
    for key, cfg in _engine_configs(config):
        if cfg.head_dtype is None:
            continue
        if cfg.is_critic:
            return f"{key}.head_dtype", f"is {cfg.head_dtype}: a critic has a value head, not an output head"
        if train is None or "fp32_head" not in train.features:
            backend = train.backend if train else None
            return f"{key}.head_dtype", f"is {cfg.head_dtype}: FSDP2 and DeepSpeed compute it, not {backend}"
    return None


def _lora_fits(config: Any) -> Problem | None:
    """LoRA is implemented on the FSDP2 engine only, and a critic's value head is no adapter target."""
    train = _allocation(config).train
    backend = train.backend if train else None
    for key, cfg in _engine_configs(config):
        if cfg.lora.rank <= 0:
            continue
        if cfg.is_critic:
            return f"{key}.lora.rank", f"is {cfg.lora.rank}: LoRA trains actors and SFT models, not a critic"
        if train is None or "lora" not in train.features:
            return (
                f"{key}.lora.rank",
                f"is {cfg.lora.rank}: LoRA is FSDP2-only for now, but allocation_mode "
                f"'{config.allocation_mode}' trains with {backend}",
            )
    return None


def _services_fit(config: Any) -> Problem | None:
    """Auxiliary servers and the reward service must match allocation_mode (``configs.services``)."""
    from tandemrl.configs.services import service_problem

    aux = getattr(config, "aux_servers", None)
    service = getattr(config, "reward_service", None)
    if aux is None and service is None:
        return None
    paths = {name: cfg.path for name, cfg in (aux or {}).items()}
    judge, url = (service.judge, service.url) if service is not None else ("", "")
    return service_problem(_allocation(config), paths, judge, url)


# LoRA's learning rate: about 10x full fine-tuning's (docs/lora.md: the main job learned with LoRA at lr 5e-4
# and with full weights at 5e-5); a LoRA run at or below this gets a warning.
LORA_LR_FLOOR = 1e-4


def advice(config: Any) -> list[str]:
    """Values that load and fit together but are likely a mistake: one line each, printed as warnings."""
    lines = []
    for key, cfg in _engine_configs(config):
        lr = getattr(cfg.optimizer, "lr", None) if cfg.optimizer is not None else None
        if cfg.lora.rank > 0 and lr is not None and 0 < lr <= LORA_LR_FLOOR:
            lines.append(
                f"{key}.optimizer.lr={lr:g} is a full fine-tuning learning rate, but {key}.lora.rank={cfg.lora.rank}: "
                f"LoRA learned here at 10x the full-weight rate (5e-4 vs 5e-5, alpha 32, ranks 1 to 32; docs/lora.md)"
            )
    return lines


def first_problem(config: Any) -> Problem | None:
    """:func:`allocation_problem`, else the first pair of values that do not fit together, or None (a config
    without ``allocation_mode`` gets no check that needs the allocation)."""
    problem = allocation_problem(config)
    if problem is not None:
        return problem
    dp, problem = _data_parallel_size(config)
    if problem is not None or dp is None:
        return problem
    return (
        _batch_splits(config, dp)
        or _addresses_valid(config)
        or _groups_fit(config, dp)
        or _samples_fill_a_batch(config)
        or _micro_batches_fit(config)
        or _turns_fit(config)
        or _async_overlaps(config)
        or _truncation_replayed(config)
        or _lora_fits(config)
        or _router_replay_fits(config)
        or _head_dtype_fits(config)
        or _services_fit(config)
    )
