"""Build a typed experiment config from schema defaults, a YAML file and command-line overrides.

Merge order is: schema defaults < YAML file (``--config``) < overrides (``key=value``).
Overrides use hydra's grammar, so values parse exactly as in hydra (``[1,2]``, ``null``,
quoted strings, ``${interp}``); sweeps are left to the launcher.  Every failure is a
:class:`ConfigError` whose message is one line naming the key (or token/file) and its source,
because a traceback from OmegaConf's internals does not tell the user what to fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from tandemrl.configs.checks import InputsChecked, allocation_problem, check_only, configs_seen, first_problem
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.distill import DistillActorConfig, DistillConfig
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.experiment import GRPOConfig, PPOConfig, SFTConfig
from tandemrl.configs.moved import retired_key
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.configs.utils import (
    ClusterConfig,
    EvaluatorConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
    TensorBoardConfig,
    WandBConfig,
)
from tandemrl.utils.cli import exit_with_error

__all__ = [
    "COMPONENT_CONFIGS",
    "PRESET_DIR",
    "ROOT_CONFIGS",
    "ConfigError",
    "config_to_dict",
    "exit_on_config_error",
    "list_presets",
    "read_config",
    "read_known_keys",
    "preset_path",
    "read_yaml",
    "register_configs",
    "save_config",
]

T = TypeVar("T")

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESET_PREFIX = "preset:"

# Root schemas and reusable components, as registered in hydra's ConfigStore.
ROOT_CONFIGS: dict[str, type] = {"sft": SFTConfig, "grpo": GRPOConfig, "ppo": PPOConfig, "distill": DistillConfig}
COMPONENT_CONFIGS: dict[tuple[str, str], type] = {
    ("model", "train_engine"): TrainEngineConfig,
    ("actor", "ppo_actor"): PPOActorConfig,
    ("actor", "distill_actor"): DistillActorConfig,
    ("teacher", "remote"): InferenceClientConfig,
    ("critic", "ppo_critic"): PPOCriticConfig,
    ("ref", "train_engine"): TrainEngineConfig,
    ("engine", "train_engine"): TrainEngineConfig,
    ("optimizer", "adamw"): OptimizerConfig,
    ("mb_spec", "default"): MicroBatchSpec,
    ("train_dataset", "dataset"): DatasetConfig,
    ("valid_dataset", "dataset"): DatasetConfig,
    ("gconfig", "default"): GenerationHyperparameters,
    ("rollout", "remote"): InferenceClientConfig,
    ("cluster", "local"): ClusterConfig,
    ("saver", "default"): SaverConfig,
    ("recover", "default"): RecoverConfig,
    ("evaluator", "default"): EvaluatorConfig,
    ("stats_logger", "default"): StatsLoggerConfig,
    ("wandb", "default"): WandBConfig,
    ("tensorboard", "default"): TensorBoardConfig,
}

_CLI = "on the command line"
_MISSING = "???"
_MAX_LISTED_KEYS = 8
_OPEN = object()  # annotation marker: below this key any key is accepted (dict/Any field)


class ConfigError(ValueError):
    """A config could not be built; the message is one line naming the key and its source."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split("\n")).strip())


# ----------------------------------------------------------------------------- schema introspection


def _is_dataclass_type(annotation: Any) -> TypeGuard[type]:
    """Whether an annotation names a dataclass (a class, not an instance)."""
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields (the schemas use ``from __future__ import annotations``)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); unions of several non-None types are treated as Any."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else Any), optional
    return annotation, False


def _is_open(annotation: Any) -> bool:
    """A field under which arbitrary keys are allowed (a dict or an untyped field)."""
    inner, _ = _unwrap_optional(annotation)
    return inner is Any or inner is dict or typing.get_origin(inner) in (dict, Mapping)


def _type_name(annotation: Any) -> str:
    """Human-readable name of an annotation, e.g. ``float``, ``list[int] or null``."""
    inner, optional = _unwrap_optional(annotation)
    origin = typing.get_origin(inner)
    if inner is Any:
        name = "any value"
    elif _is_dataclass_type(inner):
        name = f"a mapping ({inner.__name__})"
    elif isinstance(inner, type) and issubclass(inner, Enum):
        name = "one of " + ", ".join(m.name for m in inner)
    elif origin in (list, tuple):
        args = typing.get_args(inner)
        name = f"list[{_type_name(args[0])}]" if args else "list"
    elif inner is dict or origin in (dict, Mapping):
        name = "a mapping"
    elif isinstance(inner, type):
        name = inner.__name__
    else:
        name = str(inner)
    return f"{name} or null" if optional else name


def _split_key(key: str) -> list[str | int]:
    """``a.b[2].c`` -> ['a', 'b', 2, 'c']."""
    parts: list[str | int] = []
    for piece in key.split("."):
        match = re.fullmatch(r"([^\[\]]*)((?:\[\d+\])*)", piece)
        if match is None:
            parts.append(piece)
            continue
        if match.group(1):
            parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def _dataclass_values(annotation: Any) -> Any:
    """The value dataclass of a ``dict[str, SomeConfig]`` field (``aux_servers``), else None."""
    inner, _ = _unwrap_optional(annotation)
    args = typing.get_args(inner) if typing.get_origin(inner) in (dict, Mapping) else ()
    return args[1] if len(args) == 2 and dataclasses.is_dataclass(args[1]) else None


def _annotation_at(schema: type, key: str) -> Any:
    """Annotation of a dotted key, ``_OPEN`` inside a dict/Any field, None if the schema lacks it."""
    annotation: Any = schema
    for part in _split_key(key):
        if _dataclass_values(annotation) is not None:  # ``part`` names an entry: its schema is the dataclass
            annotation = _dataclass_values(annotation)
            continue
        if _is_open(annotation):
            return _OPEN
        inner, _ = _unwrap_optional(annotation)
        if isinstance(part, int):
            if typing.get_origin(inner) not in (list, tuple):
                return None
            args = typing.get_args(inner)
            annotation = args[0] if args else Any
        elif _is_dataclass_type(inner):
            fields = _field_types(inner)
            if part not in fields:
                return None
            annotation = fields[part]
        else:
            return None
    return annotation


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _unknown_key(full_key: str, parent: str, valid: list[str], where: str) -> ConfigError:
    """One-line message listing the keys closest to the mistyped one first."""
    name = full_key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    ordered = close + [k for k in valid if k not in close]
    shown = ", ".join(ordered[:_MAX_LISTED_KEYS])
    if len(ordered) > _MAX_LISTED_KEYS:
        shown += f", ... ({len(ordered) - _MAX_LISTED_KEYS} more)"
    at = f"at '{parent}'" if parent else "at top level"
    hint = f"did you mean '{_join(parent, close[0])}'? " if close else ""
    return ConfigError(f"Unknown config key '{full_key}' {where} ({hint}valid keys {at}: {shown})")


def _raise_if_retired(parent: type, prefix: str, name: str, rest: str, where: str) -> None:
    """A key that moved or was removed (``tandemrl.configs.moved``): one line naming the new key."""
    reason = retired_key(parent, prefix, name, rest)
    if reason is not None:
        raise ConfigError(f"{reason} (set {where})")


def _lookup(schema: type, key: str, where: str) -> Any:
    """Annotation of ``key`` (or ``_OPEN``); an unknown key raises naming the first bad part."""
    annotation: Any = schema
    prefix = ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if _is_open(annotation):
            return _OPEN
        inner, _ = _unwrap_optional(annotation)
        full = _join(prefix, part)
        if not _is_dataclass_type(inner):
            raise ConfigError(
                f"Unknown config key '{full}' {where} ('{prefix}' is not a mapping; it expects {_type_name(annotation)})"
            )
        _raise_if_retired(inner, prefix, part, "".join(f".{p}" for p in parts[i + 1 :]), where)
        fields = _field_types(inner)
        if part not in fields:
            raise _unknown_key(full, prefix, list(fields), where)
        annotation, prefix = fields[part], full
    return annotation


def _is_special_string(value: object) -> bool:
    """``???`` or an interpolation: OmegaConf checks these later, not the key walk."""
    return isinstance(value, str) and (value == _MISSING or "${" in value)


def _check_keys(data: Any, annotation: Any, prefix: str, where: str) -> None:
    """Reject keys the schema does not have, and scalars given where a mapping is expected."""
    if annotation is _OPEN or _is_open(annotation):
        return
    inner, optional = _unwrap_optional(annotation)
    if not _is_dataclass_type(inner) or _is_special_string(data):
        return
    if data is None:
        if optional:
            return
        raise ConfigError(f"Config key '{prefix}' {where} expects {_type_name(annotation)}, got null")
    if not isinstance(data, Mapping):
        raise ConfigError(f"Config key '{prefix}' {where} expects {_type_name(annotation)}, got {_show(data)}")
    fields = _field_types(inner)
    for key, value in data.items():
        full = _join(prefix, key)
        if isinstance(key, str):
            _raise_if_retired(inner, prefix, key, "", where)
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key(full, prefix, list(fields), where)
        _check_keys(value, fields[key], full, where)


def _show(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    return repr(value)


# ----------------------------------------------------------------------------- error translation


class _Origins:
    """Remembers which source (file or override) last set each key, to name it in later errors."""

    def __init__(self) -> None:
        self._by_key: dict[str, str] = {}

    def record(self, data: Any, prefix: str, where: str) -> None:
        if isinstance(data, Mapping) and data:
            for key, value in data.items():
                self.record(value, _join(prefix, key), where)
        elif prefix:
            self._by_key[prefix] = where

    def where(self, key: str) -> str:
        key = re.sub(r"\[\d+\]", "", key)
        while key:
            if key in self._by_key:
                return self._by_key[key]
            key = key.rpartition(".")[0]
        return "in the schema defaults"


def _first_line(err: BaseException) -> str:
    text = getattr(err, "msg", None) or str(err)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _translate(err: OmegaConfBaseException, schema: type, where: str | None, origins: _Origins) -> ConfigError:
    """Turn OmegaConf's multi-line exception into a one-line ConfigError naming key and source."""
    key = str(getattr(err, "full_key", "") or "")
    where = where or (origins.where(key) if key else "")
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(
            f"Missing required config key '{key}' (left as ??? {where}): set it in the YAML file or on the "
            f"command line, e.g. {key}=..."
        )
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(f"Config key '{key}' {where} has an unresolvable interpolation: {_first_line(err)}")
    if isinstance(err, ConfigKeyError) and key:
        parent = key.rpartition(".")[0]
        parent_type = _unwrap_optional(_annotation_at(schema, parent) if parent else schema)[0]
        valid = list(_field_types(parent_type)) if _is_dataclass_type(parent_type) else []
        return _unknown_key(key, parent, valid, where)
    if isinstance(err, ValidationError) and key:
        annotation = _annotation_at(schema, key)
        if annotation is not None and annotation is not _OPEN:
            got = _show(getattr(err, "value", None))
            return ConfigError(f"Config key '{key}' {where} expects {_type_name(annotation)}, got {got}")
    subject = f"config key '{key}'" if key else "config"
    return ConfigError(f"Invalid {subject} {where}: {_first_line(err)}")


def _check_field_values(obj: Any, prefix: str, origins: _Origins) -> None:
    """Enforce the ``choices``, ``min``, ``gt`` (exclusive minimum) and ``max`` metadata of schema fields, which OmegaConf itself ignores."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = _join(prefix, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            allowed = ", ".join(str(c) for c in choices)
            raise ConfigError(f"Config key '{key}' {origins.where(key)} expects one of {allowed}, got {_show(value)}")
        low = f.metadata.get("min")
        if low is not None and isinstance(value, (int, float)) and value < low:
            raise ConfigError(f"Config key '{key}' {origins.where(key)} must be >= {low}, got {_show(value)}")
        above = f.metadata.get("gt")
        if above is not None and isinstance(value, (int, float)) and value <= above:
            raise ConfigError(f"Config key '{key}' {origins.where(key)} must be > {above}, got {_show(value)}")
        high = f.metadata.get("max")
        if high is not None and isinstance(value, (int, float)) and value > high:
            raise ConfigError(f"Config key '{key}' {origins.where(key)} must be <= {high}, got {_show(value)}")
        _check_field_values(value, key, origins)


# ----------------------------------------------------------------------------- sources: YAML and overrides


def list_presets() -> list[str]:
    """Names of the YAML presets shipped in ``tandemrl/configs/presets``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of a packaged preset (``grpo_gsm8k``); an unknown name raises listing the valid ones."""
    path = PRESET_DIR / f"{name}.yaml"
    if not name or "/" in name or not path.is_file():
        raise ConfigError(f"Unknown preset '{name}' (available presets: {', '.join(list_presets()) or 'none'})")
    return path


def _resolve_config_arg(arg: str) -> tuple[Path, str]:
    """``--config`` value -> (absolute path, name used in messages)."""
    if arg.startswith(PRESET_PREFIX):
        name = arg[len(PRESET_PREFIX) :]
        return preset_path(name).resolve(), f"preset '{name}'"
    path = Path(arg).expanduser()
    if not path.is_file():
        what = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"Config file '{arg}' {what} (given with --config)")
    return path.resolve(), arg


def read_yaml(path: Path, shown: str) -> dict[Any, Any]:
    """Load a YAML file as a plain mapping; syntax errors are reported with their line."""
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"Cannot parse YAML file {shown}{at}: {err.problem or err.context}") from None
    except (yaml.YAMLError, OSError, OmegaConfBaseException) as err:
        raise ConfigError(f"Cannot read YAML file {shown}: {_first_line(err)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"YAML file {shown} must hold a mapping of config keys at top level, got a list")
    data = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(data, dict)
    return data


def copy_without_section(config_arg: str, section: str, out: str) -> bool:
    """Write the config file ``config_arg`` (a path or ``preset:NAME``) to ``out`` without its top-level
    ``section``, interpolations kept as written; False (nothing written) when it has no such section."""
    path, shown = _resolve_config_arg(config_arg)
    data = read_yaml(path, shown)
    if section not in data:
        return False
    data.pop(section)
    Path(out).write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), encoding="utf-8")
    return True


def _missing_leaves(data: Any, prefix: str = "") -> list[str]:
    """Keys set to ``???``: OmegaConf's merge would keep the default, but the user asked for 'required'."""
    if isinstance(data, Mapping):
        return [k for key, value in data.items() for k in _missing_leaves(value, _join(prefix, key))]
    return [prefix] if data == _MISSING and prefix else []


def _merge(cfg: DictConfig, data: dict[str, Any], schema: type, where: str, origins: _Origins) -> DictConfig:
    _check_keys(data, schema, "", where)
    try:
        merged = OmegaConf.merge(cfg, data)
        for key in _missing_leaves(data):
            OmegaConf.update(merged, key, _MISSING, merge=False)
    except OmegaConfBaseException as err:
        raise _translate(err, schema, where, origins) from None
    assert isinstance(merged, DictConfig)
    origins.record(data, "", where)
    return merged


def _nest(key: str, value: Any) -> dict[str, Any]:
    """``a.b.c``, v -> {'a': {'b': {'c': v}}}."""
    for part in reversed(key.split(".")[1:]):
        value = {part: value}
    return {key.split(".")[0]: value}


def _current(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


@functools.lru_cache(maxsize=1)
def _parser() -> Any:
    """hydra's override parser (built once: creating it is not free)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _apply_override(cfg: DictConfig, token: str, schema: type, origins: _Origins) -> DictConfig:
    """Apply one hydra-syntax override (``k=v``, ``+k=v``, ``++k=v``, ``~k``, ``~k=v``)."""
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    where = f"{_CLI} ('{token}')"
    try:
        override = _parser().parse_override(token)
    except HydraException as err:
        raise ConfigError(f"Malformed override '{token}' {_CLI}: {_first_line(err)} (expected key=value)") from None
    key = override.key_or_group
    if not key:
        raise ConfigError(f"Malformed override '{token}' {_CLI}: empty key (expected key=value)")
    if override.package is not None or "/" in key:
        raise ConfigError(
            f"Malformed override '{token}' {_CLI}: config groups and @packages are not supported; use dotted keys"
        )
    if override.is_sweep_override():
        raise ConfigError(
            f"Override '{token}' {_CLI} is a sweep; load_config takes one value per key (run sweeps with the launcher)"
        )
    annotation = _lookup(schema, key, where)
    value = override.value()

    if override.type == OverrideType.DEL:
        return _delete(cfg, key, token, value, annotation, schema, origins)
    if override.type == OverrideType.ADD and annotation is not _OPEN and _current(cfg, key) is not None:
        raise ConfigError(f"Cannot add config key '{key}' {where}: it already has a value; use {key}=... to change it")
    _check_keys(value, annotation, key, where)
    try:
        merged = OmegaConf.merge(cfg, _nest(key, value))
        for missing in _missing_leaves(value, key):
            OmegaConf.update(merged, missing, _MISSING, merge=False)
    except OmegaConfBaseException as err:
        raise _translate(err, schema, where, origins) from None
    assert isinstance(merged, DictConfig)
    origins.record(value, key, where)
    return merged


def _delete(
    cfg: DictConfig, key: str, token: str, expected: Any, annotation: Any, schema: type, origins: _Origins
) -> DictConfig:
    """``~key``: an optional field becomes null, a key of an open dict is removed; others are required."""
    where = f"{_CLI} ('{token}')"
    if expected is not None and _current(cfg, key) != expected:
        raise ConfigError(
            f"Cannot delete config key '{key}' {where}: its value is {_show(_current(cfg, key))}, not {_show(expected)}"
        )
    if annotation is _OPEN:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent:
            raise ConfigError(f"Cannot delete config key '{key}' {where}: it is not set")
        with open_dict(parent):
            del parent[leaf]
        return cfg
    if not _unwrap_optional(annotation)[1]:
        raise ConfigError(
            f"Cannot delete config key '{key}' {where}: it is not optional (expects {_type_name(annotation)}); "
            f"set a value instead"
        )
    try:
        merged = OmegaConf.merge(cfg, _nest(key, None))
    except OmegaConfBaseException as err:
        raise _translate(err, schema, where, origins) from None
    assert isinstance(merged, DictConfig)
    origins.record(None, key, where)
    return merged


def _split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """Separate ``--config FILE`` from the overrides; reject options handled elsewhere."""
    config: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--multirun", "-m"):
            raise ConfigError(
                f"'{arg}' is not supported here: sweeps (multirun) are expanded by the launcher, "
                "not by load_config; pass one value per key"
            )
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    raise ConfigError("Option --config needs a value: --config FILE.yaml or --config preset:NAME")
                value = argv[i + 1]
                i += 1
            else:
                value = arg.split("=", 1)[1]
            if not value:
                raise ConfigError("Option --config needs a value: --config FILE.yaml or --config preset:NAME")
            if config is not None:
                raise ConfigError(f"Option --config given twice ('{config}' and '{value}'); pass one YAML file")
            config = value
        elif arg.startswith("-"):
            raise ConfigError(f"Unknown option '{arg}' {_CLI} (expected --config FILE.yaml and key=value overrides)")
        else:
            overrides.append(arg)
        i += 1
    return config, overrides


# ----------------------------------------------------------------------------- public API


def register_configs() -> None:
    """Store the root schemas (``sft``, ``grpo``, ``ppo``) and component configs in hydra's ConfigStore.

    This lets hydra-based tools (``hydra.compose``, ``@hydra.main``) build the same configs; calling it
    again overwrites the same entries.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, node in ROOT_CONFIGS.items():
        store.store(name=name, node=node)
    for (group, name), node in COMPONENT_CONFIGS.items():
        store.store(group=group, name=name, node=node)


# A script's own check of values that fit its algorithm: (key, message) or None (e.g. reinforce.config_problem).
ConfigCheck = Callable[[Any], "tuple[str, str] | None"]


def read_config(
    argv: list[str],
    schema: type[T],
    checks: Sequence[ConfigCheck] = (),
) -> tuple[T, str]:
    """Build a ``schema`` instance from ``argv`` (without the program name).

    ``argv`` holds an optional ``--config FILE.yaml`` (or ``--config preset:NAME``) and hydra-style
    overrides.  Returns the dataclass with interpolations resolved, and the absolute YAML path ("" if none).
    ``allocation_mode`` must parse against the backend rows (``configs.backends``; the config's
    ``allocation`` is the parsed value), and values must fit together
    (``tandemrl.configs.checks.first_problem``, then each of the script's ``checks``: what only its
    algorithm knows, e.g. ReMax's REINFORCE step). With
    ``TANDEMRL_CHECK_ONLY=1`` (the launchers' pre-flight) it raises ``InputsChecked`` instead of
    returning; scripts load through ``tandemrl.trainers.entry``, which then checks the inputs too.
    """
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"read_config needs a dataclass schema, got {schema!r}")
    if check_only():
        configs_seen[0] += 1
    obj, config_path = _build(argv, schema, known_only=False, checks=tuple(checks))
    if check_only():
        raise InputsChecked(config_path, obj)
    return obj, config_path


def read_known_keys(argv: list[str], schema: type[T], own: Sequence[str] = ()) -> T:
    """The part of a script's config that ``schema`` declares, typed and checked as :func:`read_config` does.

    For a reader that knows only some of a script's keys (the launchers): keys ``schema`` lacks are
    left out instead of refused, and values are not checked against each other (the script's own
    pre-flight does both). ``own`` names top-level sections that belong to the reader alone (the
    launchers' ``launcher``): no script checks them, so their unknown keys are refused as
    :func:`read_config` refuses them. ``allocation_mode`` must parse, as there.
    """
    return _build(argv, schema, known_only=True, own=tuple(own))[0]


def _known(data: Any, annotation: Any, own: tuple[str, ...] = ()) -> Any:
    """``data`` without the keys ``annotation`` (a dataclass, or a dict of them) lacks, at any depth; the
    top-level sections in ``own`` are kept whole."""
    inner, _ = _unwrap_optional(annotation)
    if not isinstance(data, Mapping) or not (isinstance(inner, type) and dataclasses.is_dataclass(inner)):
        return data
    fields = _field_types(inner)
    return {
        k: v if k in own else _known(v, fields[k])
        for k, v in data.items()
        if isinstance(k, str) and (k in fields or k in own)
    }


def _build(
    argv: list[str],
    schema: type[T],
    known_only: bool,
    own: tuple[str, ...] = (),
    checks: tuple[ConfigCheck, ...] = (),
) -> tuple[T, str]:
    """Defaults < YAML < overrides, typed and checked; ``known_only`` drops the keys ``schema`` lacks (but
    those under the sections in ``own``) and skips the checks of values against each other."""
    config_arg, overrides = _split_argv(list(argv))
    origins = _Origins()
    try:
        cfg = OmegaConf.structured(schema)
    except OmegaConfBaseException as err:
        raise ConfigError(f"Schema {schema.__name__} is not a valid structured config: {_first_line(err)}") from None

    config_path = ""
    if config_arg is not None:
        path, shown = _resolve_config_arg(config_arg)
        data = read_yaml(path, shown)
        cfg = _merge(cfg, _known(data, schema, own) if known_only else data, schema, f"in {shown}", origins)
        config_path = str(path)
    if overrides:
        register_configs()
    for token in overrides:
        key = token.lstrip("+~").split("=", 1)[0]
        if not known_only or key.split(".", 1)[0] in own or _annotation_at(schema, key) is not None:
            cfg = _apply_override(cfg, token, schema, origins)

    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _translate(err, schema, None, origins) from None
    _check_field_values(obj, "", origins)
    problem = allocation_problem(obj) if known_only else first_problem(obj)
    for check in checks:
        problem = problem or check(obj)
    if problem is not None:
        key, message = problem
        raise ConfigError(f"Config key '{key}' {origins.where(key)} {message}")
    return typing.cast(T, obj), config_path


F = TypeVar("F", bound=Callable[..., Any])


def exit_on_config_error(fn: F) -> F:
    """Decorate a ``main()`` so any ConfigError it raises prints one line and exits with status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            exit_with_error(err)

    return typing.cast(F, wrapper)


def _as_omegaconf(config: Any) -> DictConfig:
    if isinstance(config, DictConfig):
        return config
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"expected a dataclass config or DictConfig, got {type(config).__name__}")
    try:
        structured: DictConfig = OmegaConf.structured(config)
    except OmegaConfBaseException as err:
        raise _translate(err, type(config), "in the given config object", _Origins()) from None
    return structured


def config_to_dict(config: Any, resolve: bool = True) -> dict[str, Any]:
    """A plain nested dict of a config (e.g. to log hyperparameters)."""
    node = _as_omegaconf(config)
    try:
        data = OmegaConf.to_container(node, resolve=resolve)
    except OmegaConfBaseException as err:
        raise _translate(err, type(config), "in the given config object", _Origins()) from None
    assert isinstance(data, dict)
    return typing.cast(dict[str, Any], data)


def save_config(config: Any, path: str | os.PathLike[str], resolve: bool = True) -> Path:
    """Write a config as YAML (loadable again with ``--config``) so each run records what it ran with."""
    node = _as_omegaconf(config)
    try:
        text = OmegaConf.to_yaml(node, resolve=resolve)
    except OmegaConfBaseException as err:
        raise _translate(err, type(config), "in the given config object", _Origins()) from None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target.resolve()
