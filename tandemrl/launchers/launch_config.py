"""The config values a launcher needs, read before any process starts.

The launcher does not know the training script's schema; it reads the YAML plus dotted overrides
with the scripts' loader (``configs.loader.read_known_keys``) against :class:`LaunchView`, the
shipped experiment configs' keys typed by the dataclasses that own them, so each value and default
is the one the script gets. Keys outside it are left to the script's own pre-flight
(``launchers.check``). The ``launcher`` section is the launchers' own (scripts never see it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tandemrl.api.allocation import AllocationMode
from tandemrl.api.inference import serves_adapter
from tandemrl.configs.experiment import GRPOConfig, SFTConfig
from tandemrl.configs.launcher import LauncherConfig, launcher_problem
from tandemrl.configs.loader import copy_without_section, read_known_keys
from tandemrl.configs.openenv import OpenEnvConfig
from tandemrl.configs.utils import RecoverConfig
from tandemrl.inference.backend import flag_name
from tandemrl.launchers.placement import visible_gpus

# Keys that may hold the policy model, in the order they are looked for.
MODEL_KEYS = ("actor.engine.path", "model.path")


@dataclass
class LaunchView(GRPOConfig, SFTConfig):
    """The keys of the shipped experiment configs (RL and SFT) with their own types and defaults, the
    launchers' own section and the environment server a run may name: what the launcher reads of a config."""

    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    openenv: OpenEnvConfig | None = None


@dataclass
class AuxServer:
    """An auxiliary inference server to start: allocation component ``name``, its model and extra flags."""

    name: str
    model_path: str
    server_args: dict[str, Any] = field(default_factory=dict)


class LaunchError(RuntimeError):
    """The launcher itself cannot go on (no cluster, no ``sbatch``): one line, exit code 1."""


@dataclass
class LaunchSpec:
    """What the launcher starts for one trial."""

    allocation: AllocationMode
    experiment_name: str
    trial_name: str
    fileroot: str
    model_path: str
    model_key: str
    corpus_path: str | None = None
    server_timeout: float = 600.0
    server_extra: dict[str, Any] = field(default_factory=dict)
    weight_update_mode: str = "collective"  # GRPOConfig's default; "disk" survives a lost server
    aux_servers: list[AuxServer] = field(default_factory=list)  # the allocation's aux components, in order
    server_addrs: list[str] = field(default_factory=list)  # rollout.server_addrs: running servers, none started
    env_server: OpenEnvConfig | None = None  # the openenv section when it names a server app to start
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # the launchers' own section
    recover_mode: str = RecoverConfig.mode  # recover.mode: with "disabled" a finished run starts over
    deterministic: bool = False  # the run's ``deterministic``: the servers' warm-up ends before the trainer starts
    length: dict[str, Any] = field(default_factory=dict)  # total_train_steps / _epochs (a finished run's are kept)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.fileroot, "logs", self.experiment_name, self.trial_name)

    def resolve_model(self) -> None:
        """Fail before starting anything if the model is missing (and build tiny: models)."""
        from tandemrl.models.resolve import resolve_model_path

        if self.model_path or self.allocation.gen is not None:
            self.model_path = resolve_model_path(self.model_path, self.model_key, corpus_path=self.corpus_path)
        for aux in self.aux_servers:
            key = f"aux_servers.{aux.name}.path"
            aux.model_path = resolve_model_path(aux.model_path, key, corpus_path=self.corpus_path)


def read_launch_spec(config_path: str | None, overrides: list[str]) -> LaunchSpec:
    """Parse and check the launch-relevant values; one-line errors name the key."""
    argv = (["--config", config_path] if config_path else []) + list(overrides)
    view = read_known_keys(argv, LaunchView, own=(LAUNCHER_SECTION,))
    problem = launcher_problem(view.launcher)
    if problem is not None:
        raise ValueError(f"config key '{problem[0]}' {problem[1]}")
    alloc = view.allocation  # read_known_keys checked that it parses
    if alloc.train is None:
        raise ValueError(f"allocation_mode '{view.allocation_mode}' has no training component")
    model_key, model_path = MODEL_KEYS[0], ""
    for key, path in zip(MODEL_KEYS, (view.actor.engine.path, view.model.path), strict=True):
        if path:
            model_key, model_path = key, path
            break
    server_extra = _server_extra(view, alloc)
    if view.rollout.server_addrs and server_extra:
        raise ValueError(
            f"rollout.server_addrs names running servers, so the server flags {sorted(server_extra)} "
            f"({LAUNCHER_SECTION}.server_args, LoRA) are not applied by the launcher: start those servers with them "
            "and leave them out here"
        )
    return LaunchSpec(
        allocation=alloc,
        experiment_name=view.experiment_name,
        trial_name=view.trial_name,
        fileroot=view.cluster.fileroot,
        model_path=model_path,
        model_key=model_key,
        corpus_path=view.train_dataset.path or None,
        server_timeout=view.rollout.setup_timeout,
        weight_update_mode=view.weight_update_mode,
        server_extra=server_extra,
        aux_servers=_aux_servers(view, alloc),
        server_addrs=list(view.rollout.server_addrs),
        env_server=_env_server(view.openenv),
        launcher=view.launcher,
        recover_mode=view.recover.mode,
        deterministic=view.deterministic,
        length={"total_train_steps": view.total_train_steps, "total_train_epochs": view.total_train_epochs},
    )


def _env_server(section: OpenEnvConfig | None) -> OpenEnvConfig | None:
    """The ``openenv`` section when it names a server app (the launcher starts it), checked; else None."""
    if section is None:
        return None
    from tandemrl.workflows.openenv import check_config

    check_config(section)
    return section if section.app and not section.url else None


def _aux_servers(view: LaunchView, alloc: AllocationMode) -> list[AuxServer]:
    """The auxiliary servers ``aux_servers`` configures, checked against allocation_mode (one line naming the key)."""
    from tandemrl.configs.services import service_problem

    paths = {name: aux.path for name, aux in view.aux_servers.items()}
    service = view.reward_service
    problem = service_problem(AllocationMode(alloc.components, str(alloc)), paths, service.judge, service.url)
    if problem is not None:
        raise ValueError(f"config key '{problem[0]}' {problem[1]}")
    return [
        AuxServer(str(c.name), paths[str(c.name)], dict(view.aux_servers[str(c.name)].server_args)) for c in alloc.aux
    ]


def _server_extra(view: LaunchView, alloc: AllocationMode) -> dict[str, Any]:
    """The generation servers' extra flags: ``launcher.server_args`` (the user's, in the backend's own
    option names, over the placement's flags) plus the LoRA flags the run needs; one line names a bad key."""
    key = f"{LAUNCHER_SECTION}.server_args"
    table = view.launcher.server_args
    if not all(isinstance(k, str) and k.strip("-_") for k in table):
        raise ValueError(f"config key '{key}' must map server option names to values, e.g. {{max_num_seqs: 64}}")
    args = {flag_name(k): v for k, v in table.items()}  # a mapping is passed as one JSON value (cli_flags)
    if alloc.gen_backend is not None and args:
        from tandemrl.api.types import ParallelStrategy
        from tandemrl.inference.registry import get_backend

        backend = get_backend(alloc.gen_backend)
        try:  # the flags the backend sets itself (model, host, port, parallel sizes) are refused here
            backend.server_command("model", "127.0.0.1", 1, ParallelStrategy(), args)
        except ValueError as err:
            raise ValueError(f"config key '{key}': {err}") from None
        unknown = backend.unknown_flags(list(args))  # misspelt ones, before a server starts
        if unknown:
            raise ValueError(f"config key '{key}': {alloc.gen_backend} servers have no flag {unknown[0]}")
    lora = _lora_server_extra(view, alloc)
    for name, needed in lora.items():
        if name in args and args[name] != needed:
            raise ValueError(f"config key '{key}.{name}'={args[name]!r}: LoRA updates by disk need {name}={needed!r}")
    return {**_deterministic_server_extra(view, alloc, args), **args, **lora}


def _deterministic_server_extra(view: LaunchView, alloc: AllocationMode, args: dict[str, Any]) -> dict[str, Any]:
    """``deterministic=true``: the generation backend's ``deterministic_flags`` (vLLM: whole prefills), unless the
    user's server_args say anything about those flags, or the servers are running ones (``rollout.server_addrs``:
    their flags are whoever started them, docs/determinism.md)."""
    if not view.deterministic or alloc.gen is None or view.rollout.server_addrs:
        return {}
    from tandemrl.inference.registry import backend_class

    flags: dict[str, Any] = backend_class(alloc.gen.backend).deterministic_flags
    if any(_flag_key(k) == _flag_key(f) for k in args for f in flags):
        return {}
    return dict(flags)


def _flag_key(flag: str) -> str:
    """A flag name without its negation (``no_enable_chunked_prefill`` and ``enable_chunked_prefill`` match)."""
    return flag_name(flag).removeprefix("no_")


def _lora_server_extra(view: LaunchView, alloc: AllocationMode) -> dict[str, Any]:
    """vLLM servers load the actor's LoRA adapter at run time when disk updates will send it alone:
    ``lora.serve: adapter``, or ``auto`` on a machine with GPUs (a CPU run pushes merged weights, docs/lora.md)."""
    lora = view.actor.engine.lora
    gen = alloc.gen
    if lora.rank <= 0 or view.weight_update_mode != "disk" or gen is None or "lora_adapters" not in gen.features:
        return {}
    if not serves_adapter(lora.serve, on_gpu=bool(visible_gpus())):
        return {}
    from tandemrl.inference.registry import get_backend

    return get_backend(gen.backend).lora_flags(lora.rank)


LAUNCHER_SECTION = "launcher"  # settings of the launchers themselves (launcher.slurm.*), unknown to scripts


def script_config(config_path: str | None, overrides: list[str], out: str) -> tuple[str | None, list[str]]:
    """The config file and overrides a training script gets: without the ``launcher`` section.

    A config file holding that section is copied to ``out`` without it; others are used as they are.
    """
    kept = [o for o in overrides if not o.lstrip("+~").startswith(f"{LAUNCHER_SECTION}.")]
    if not config_path:
        return None, kept
    if not copy_without_section(config_path, LAUNCHER_SECTION, out):
        return (os.path.abspath(config_path) if os.path.isfile(config_path) else config_path), kept
    return out, kept
