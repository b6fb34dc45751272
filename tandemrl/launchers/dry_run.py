"""``--dry-run`` of every launcher: the derived batch arithmetic and the resolved config; nothing starts.

The config shown is the keys whose values differ from the schema's defaults (``TANDEMRL_VERBOSE=1``: every key).

The launchers' pre-flight (``tandemrl.launchers.check``) builds each trial's config with the
script's own schema. With :data:`REPORT_ENV` naming a file it also writes :func:`config_report`
there; the launcher prints it (:func:`print_reports`) and exits 0 before starting any server,
trainer, Ray cluster or sbatch job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandemrl.api.allocation import AllocationMode
from tandemrl.configs.backends import parse_allocation
from tandemrl.launchers.launch_config import LaunchSpec
from tandemrl.utils.quiet import verbose

FLAG = "--dry-run"
REPORT_ENV = "TANDEMRL_DRY_RUN_REPORT"  # where the pre-flight writes the report


def allocation_lines(alloc: AllocationMode) -> list[str]:
    """Trainer ranks and servers that ``allocation_mode`` asks for."""
    lines = []
    if alloc.train is not None:
        s = alloc.train.strategy
        lines.append(
            f"trainer: {alloc.train_world_size} {alloc.train_backend} ranks "
            f"(data-parallel {s.dp}, tensor {s.tp}, pipeline {s.pp})"
        )
    gen = alloc.gen
    if gen is None:
        lines.append("servers: none")
    else:
        shared = alloc.train is not None and alloc.colocated(gen, alloc.train)
        lines.append(
            f"servers: {gen.strategy.dp} {gen.backend}, {gen.strategy.tp * gen.strategy.pp} devices each, "
            + ("sharing the trainer's devices" if shared else "on devices of their own")
        )
    for aux in alloc.aux:
        per = aux.strategy.tp * aux.strategy.pp
        lines.append(f"auxiliary server {aux.name}: {aux.strategy.dp} {aux.backend}, {per} devices each")
    return lines


def _longest(config: Any) -> tuple[int, str] | None:
    """Tokens of the longest training sequence the data and sampler allow, and why; None if unbounded."""
    train, gconfig = config.train_dataset, getattr(config, "gconfig", None)
    if train.max_length is None:
        return None
    if train.type == "rl" and gconfig is not None:
        n = train.max_length + gconfig.max_new_tokens
        return n, f"train_dataset.max_length {train.max_length} + gconfig.max_new_tokens {gconfig.max_new_tokens}"
    return train.max_length, "train_dataset.max_length"


def _micro_batch_line(config: Any) -> str | None:
    actor = getattr(config, "actor", None)
    engine = getattr(actor, "engine", None) or getattr(config, "model", None)
    spec = getattr(engine, "mb_spec", None)
    if spec is None:
        return None
    longest = _longest(config)
    seq = f"longest sequence {longest[0]} tokens ({longest[1]})" if longest else "longest sequence: model context"
    if spec.max_tokens_per_mb is None:
        return f"token budget per micro-batch: none, at least {spec.n_mbs} micro-batches per minibatch; {seq}"
    fits = f", {spec.max_tokens_per_mb // longest[0]} whole sequences at most" if longest else ""
    return f"token budget per micro-batch: {spec.max_tokens_per_mb} tokens{fits}; {seq}"


def _in_flight_line(rollout: Any, per_rank: int) -> str:
    """How many episodes each data-parallel rank keeps running, and where the number comes from."""
    k = rollout.max_head_offpolicyness
    if rollout.max_concurrent_rollouts is not None:
        return (
            f"episodes in flight: at most {rollout.max_concurrent_rollouts} per rank (rollout.max_concurrent_rollouts)"
        )
    return (
        f"episodes in flight: at most {rollout.concurrency(per_rank)} per rank "
        f"((max_head_offpolicyness {k} + 1) x {per_rank} prompts per rank; set rollout.max_concurrent_rollouts to cap)"
    )


def batch_lines(config: Any, rows: int | None) -> list[str]:
    """What one step holds and how many steps there are, from a loaded experiment config.

    ``rows`` is the train split's row count (at most ``max_samples``), None if unknown.
    """
    alloc = parse_allocation(config.allocation_mode)
    dp = alloc.train.strategy.dp if alloc.train is not None else 1
    train, gconfig = config.train_dataset, getattr(config, "gconfig", None)
    prompts = train.batch_size
    lines = [f"prompts per step: {prompts} (train_dataset.batch_size), {prompts // dp} per data-parallel rank"]
    if gconfig is not None:
        samples = prompts * gconfig.n_samples
        lines.append(f"samples per step: {samples} (x gconfig.n_samples {gconfig.n_samples}), {samples // dp} per rank")
        actor = getattr(config, "actor", None)
        if actor is not None:
            per_rank = samples // dp
            lines.append(
                f"updates per step: {actor.ppo_n_epochs * actor.ppo_n_minibatches} (actor.ppo_n_epochs "
                f"{actor.ppo_n_epochs} x actor.ppo_n_minibatches {actor.ppo_n_minibatches}), groups of "
                f"{actor.group_size}, about {per_rank // actor.ppo_n_minibatches} samples per rank each"
            )
    mb = _micro_batch_line(config)
    if mb is not None:
        lines.append(mb)
    if rows is None:
        lines.append(f"steps per epoch: unknown until {train.path} is built")
        epoch_steps = None
    else:
        epoch_steps = max(1, rows // prompts)
        lines.append(
            f"steps per epoch: {epoch_steps} ({rows} rows of {train.path} split {train.split} // {prompts}; "
            "rows over train_dataset.max_length are dropped at start)"
        )
    if config.total_train_steps is not None:
        lines.append(f"total steps: {config.total_train_steps} (total_train_steps)")
    elif epoch_steps is not None:
        lines.append(f"total steps: {config.total_train_epochs * epoch_steps} ({config.total_train_epochs} epochs)")
    rollout = getattr(config, "rollout", None)
    if rollout is not None:
        from tandemrl.configs.experiment import async_enabled

        mode = "async" if async_enabled(config) else "sync"
        lines.append(
            f"rollout: {mode}, rollout.max_head_offpolicyness {rollout.max_head_offpolicyness}, "
            f"rollout.pause_mode {rollout.pause_mode}"
        )
        lines.append(_in_flight_line(rollout, prompts // dp))
    return lines + allocation_lines(alloc)


def config_report(config: Any) -> str:
    """The report the pre-flight writes: :func:`batch_lines`, then the resolved config as YAML."""
    import yaml

    from tandemrl.configs.loader import config_to_dict
    from tandemrl.data.loader import check_dataset_inputs

    rows = check_dataset_inputs(config.train_dataset) if hasattr(config, "train_dataset") else None
    lines = batch_lines(config, rows) if hasattr(config, "train_dataset") else []
    resolved = config_to_dict(config)
    changed = None if verbose() else _changed(resolved, _defaults(config))
    if changed is None:
        text: str = yaml.safe_dump(resolved, sort_keys=False, default_flow_style=False)
    else:
        head = f"# the keys that differ from {type(config).__name__}'s defaults (every key: TANDEMRL_VERBOSE=1)\n"
        text = head + yaml.safe_dump(changed, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\nresolved config:\n" + text


def _defaults(config: Any) -> dict[str, Any] | None:
    """The schema's own defaults, interpolations unresolved; None if the schema has required fields."""
    from tandemrl.configs.loader import config_to_dict

    try:
        return config_to_dict(type(config)(), resolve=False)
    except (TypeError, ValueError):
        return None


def _changed(resolved: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any] | None:
    """The leaves of ``resolved`` that differ from ``defaults``; a default that is an interpolation
    (``${experiment_name}``) follows its source and is left out. None: nothing to compare with."""
    if defaults is None:
        return None
    out: dict[str, Any] = {}
    for key, value in resolved.items():
        base = defaults.get(key, object())
        if isinstance(base, str) and "${" in base:
            continue
        if isinstance(value, dict) and isinstance(base, dict):
            sub = _changed(value, base)
            if sub:
                out[key] = sub
        elif value != base:
            out[key] = value
    return out


def print_reports(script: str, specs: Sequence[tuple[list[str], LaunchSpec]], reports: Sequence[str | None]) -> None:
    """Each trial's report (or, for a script whose config could not be built, its allocation)."""
    for (_, spec), report in zip(specs, reports, strict=True):
        print(f"[launcher] dry run of trial {spec.trial_name} (nothing started, run dir {spec.run_dir}):")
        if report is None:
            report = "\n".join(
                [f"{script} does not build its config with load_config: no batch arithmetic"]
                + allocation_lines(spec.allocation)
            )
        if spec.allocation.gen is not None:
            report = report.replace(
                "\nresolved config:",
                f"\nserver watchdog: a server silent {spec.launcher.server_stall_warn:g}s is reported, "
                f"{spec.launcher.server_stall_limit:g}s stops the run (launcher.server_stall_warn, launcher.server_stall_limit)"
                "\nresolved config:",
                1,
            )
        print(report.rstrip("\n"), flush=True)
