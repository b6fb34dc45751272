"""A training script's entry: load its config, and in the launchers' pre-flight check what it points to.

``load_config`` is ``tandemrl.configs.loader.read_config`` (``allocation_mode`` must parse against
the backends of ``tandemrl.configs.backends``; a config's ``allocation`` is the typed value).
``load_script_config`` is ``load_config`` plus, in a check-only run
(``TANDEMRL_CHECK_ONLY=1``, see ``tandemrl.launchers.check``), a look at the model directories
and dataset files the config names before the script stops. It lives above ``configs`` because
those checks need ``data`` and ``models``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from tandemrl.configs.checks import InputsChecked, advice
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.loader import ConfigCheck, ConfigError, read_config
from tandemrl.data.loader import check_dataset_inputs
from tandemrl.data.reasoning_gym import ensure_written
from tandemrl.models.hf import check_tokenizer_dir
from tandemrl.models.resolve import resolve_model_path
from tandemrl.trainers.determinism import enable_determinism
from tandemrl.utils.cli import exit_with_error

T = TypeVar("T")

# Engine configs (TrainEngineConfig) that may name a model directory, as dotted keys.
_ENGINE_KEYS = ("actor.engine", "model", "ref", "critic.engine")
_REQUIRED_ENGINES = ("actor.engine", "model")  # ref and critic default to the actor's path
_DATASET_KEYS = ("train_dataset", "valid_dataset")


def load_config(argv: list[str], schema: type[T], checks: Sequence[ConfigCheck] = ()) -> tuple[T, str]:
    """``read_config`` with the script's ``checks``: the typed config and its YAML path ("" if none)."""
    return read_config(argv, schema, checks)


def _at(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part, None)
    return config


def _check_servers(config: Any) -> None:
    """An RL config generates on inference servers: an allocation_mode without them cannot run."""
    from tandemrl.configs.experiment import GRPOConfig

    if not isinstance(config, GRPOConfig):
        return
    mode = config.allocation_mode
    if config.allocation.gen is None:
        raise ValueError(
            f"allocation_mode: '{mode}' has no inference component, but {type(config).__name__} generates its "
            f"samples on inference servers: e.g. 'vllm:d1+{mode}' (servers apart) or 'vllm:d1|{mode}' (colocated)"
        )


def check_inputs(config: Any) -> None:
    """Model paths and dataset files the config points to; raises one line naming the key or file. Datasets the
    config generates (``reasoning_gym.tasks``, a ``verifiers`` environment's tasks) are written to their path here."""
    _check_servers(config)
    for key in _ENGINE_KEYS:
        path = getattr(_at(config, key), "path", None)
        if not isinstance(path, str):
            continue
        if path or key in _REQUIRED_ENGINES:
            resolve_model_path(path, f"{key}.path", build=False)  # tiny: / smollm2: checked, not built
        tokenizer = getattr(_at(config, key), "tokenizer_path", "")
        if tokenizer:
            check_tokenizer_dir(tokenizer, f"{key}.tokenizer_path")
    _check_run_tokenizer(config)
    _write_environment_tasks(config)
    for key in _DATASET_KEYS:
        ds = getattr(config, key, None)
        if isinstance(ds, DatasetConfig):
            ensure_written(ds, key)  # reasoning-gym rows: generated here, before any process starts
            try:
                check_dataset_inputs(ds)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"{key}.path: {err}") from None


def _write_environment_tasks(config: Any) -> None:
    """A verifiers environment's tasks, or an OpenEnv environment's reset seeds, are the run's rows: written to
    ``train_dataset.path`` once, here, so a missing environment or package is one line before any process starts."""
    from tandemrl.configs.openenv import OpenEnvConfig
    from tandemrl.configs.verifiers import VerifiersConfig

    env = getattr(config, "verifiers", None)
    if isinstance(env, VerifiersConfig) and env.env:
        from tandemrl.workflows.verifiers import ensure_task_rows

        ensure_task_rows(env, config.train_dataset.path)
    openenv = getattr(config, "openenv", None)
    if isinstance(openenv, OpenEnvConfig):
        from tandemrl.workflows.openenv import check_config, ensure_seed_rows

        check_config(openenv)
        ensure_seed_rows(openenv, config.train_dataset.path)


def _check_run_tokenizer(config: Any) -> None:
    """The tokenizer the trainer loads: ``tokenizer_path``, else the policy model's own directory."""
    if getattr(config, "tokenizer_path", ""):
        check_tokenizer_dir(config.tokenizer_path, "tokenizer_path")
        return
    for key in _REQUIRED_ENGINES:
        path = getattr(_at(config, key), "path", None)
        if isinstance(path, str) and path and os.path.isdir(os.path.expanduser(path)):
            check_tokenizer_dir(path, f"{key}.path")
            return


def load_script_config(argv: list[str], schema: type[T], checks: Sequence[ConfigCheck] = ()) -> tuple[T, str]:
    """``load_config``; in a check-only run (the launchers' pre-flight, before anything starts) it also checks
    the inputs, then stops with ``InputsChecked``.

    A config with ``deterministic: true`` switches this rank to deterministic mode
    (``tandemrl.trainers.determinism``).
    """
    try:
        config, path = load_config(argv, schema, checks)
    except InputsChecked as done:
        check_inputs(done.config)
        raise
    if getattr(config, "deterministic", False):
        enable_determinism(int(cast(Any, config).seed))
    if os.environ.get("RANK", "0") == "0":
        for line in advice(config):
            print(f"warning: {line}", file=sys.stderr, flush=True)
    return config, path


def load_config_or_exit(argv: list[str], schema: type[T], checks: Sequence[ConfigCheck] = ()) -> tuple[T, str]:
    """:func:`load_script_config` for ``main()``: a bad config prints ``error: <one line>`` and exits with status 2."""
    try:
        return load_script_config(argv, schema, checks)
    except ConfigError as err:
        exit_with_error(err)
