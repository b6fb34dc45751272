"""Local launcher: inference servers + a torchrun trainer on this machine.

    python -m tandemrl.launchers.local SCRIPT --config YAML [key=value ...]
    python -m tandemrl.launchers.local SCRIPT --config YAML --multirun a=1,2 b=x,y
    python -m tandemrl.launchers.local SCRIPT --config YAML [key=value ...] --dry-run

Reads ``allocation_mode``, starts the inference servers it describes on free loopback
ports, waits until they are healthy, exports their addresses in
``TANDEMRL_LLM_SERVER_ADDRS`` and those of the auxiliary servers (a judge, a teacher: every
other inference component, its model from ``aux_servers.<name>``) in ``TANDEMRL_AUX_SERVER_ADDRS``
(``tandemrl.api.aux_servers``; vLLM servers require a fresh per-run bearer token, passed
in ``TANDEMRL_SERVER_TOKEN``), runs SCRIPT under torchrun on the training world size with
prefixed logs copied into the run directory while watching the servers (``server_watch``),
and tears everything down on success, failure or Ctrl-C. ``--multirun`` runs every combination of the comma-separated values as
its own trial, one after the other, and prints a summary table (see ``common``). ``--dry-run``
prints each trial's batch arithmetic and resolved config and starts nothing (``dry_run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.api.allocation import AllocationComponent, AllocationMode
from tandemrl.api.aux_servers import AUX_SERVERS_ENV, OPENENV_URL_ENV, format_aux_addresses
from tandemrl.inference.remote import SERVER_ADDRS_ENV
from tandemrl.inference.server_auth import TOKEN_ENV, new_token
from tandemrl.launchers import common, dry_run
from tandemrl.launchers.common import (
    TrialResult,
    guarded_trial,
    kill_group,
    parse_args,
    plan_trials,
    pump,
    run_trials,
    torchrun_log_args,
    trainer_failure,
)
from tandemrl.launchers.launch_config import LaunchSpec, script_config
from tandemrl.launchers.placement import Placement, oversubscription, plan_placement, visible_cpus, visible_gpus
from tandemrl.launchers.server_watch import StallBounds, wait_trainer
from tandemrl.utils.cli import TRAINER_LOG_ENV
from tandemrl.utils.lifeline import lifeline_command


@dataclass
class _Children:
    """Processes this launcher owns; stopped together on any exit."""

    servers: list[Any] = field(default_factory=list)
    aux: list[tuple[str, Any]] = field(default_factory=list)  # (name, server) of the auxiliary servers
    trainer: subprocess.Popen[Any] | None = None
    env_server: Any = None  # an OpenEnv environment server (tandemrl.workflows.openenv.EnvServer)

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            kill_group(self.trainer)
        for server in [*self.servers, *(s for _, s in self.aux)]:
            server.stop()
        self.servers.clear()
        self.aux.clear()
        if self.env_server is not None:
            self.env_server.stop()
            self.env_server = None


def start_servers(
    spec: LaunchSpec,
    alloc: AllocationMode,
    run_dir: Path,
    children: _Children,
    token: str | None,
    placement: Placement,
) -> list[str]:
    """One server per inference data-parallel replica, auxiliary ones too; returns the generation servers' addresses.

    The auxiliary servers' addresses are in ``children.aux``.
    """
    gen = alloc.gen
    if gen is None:
        return []
    if not spec.server_addrs:  # running servers (rollout.server_addrs) are used as they are
        extra = {**placement.server_flags, **spec.server_extra}
        children.servers += _launch(gen, spec.model_path, extra, placement.server_env, run_dir, token, "")
    for aux in spec.aux_servers:
        comp = alloc.get(aux.name)
        servers = _launch(comp, aux.model_path, aux.server_args, placement.aux_env[aux.name], run_dir, token, aux.name)
        children.aux += [(aux.name, s) for s in servers]
    for server in [*children.servers, *(s for _, s in children.aux)]:
        server.wait_healthy(timeout=spec.server_timeout)
    warming = [server.warm_up(token) for server in children.servers]  # while the trainer starts
    if spec.deterministic:  # no warm-up request may share an engine step with the run's first requests
        for thread in warming:
            thread.join()
    return list(spec.server_addrs) or [s.address for s in children.servers]


def _launch(
    comp: AllocationComponent,
    model_path: str,
    extra: dict[str, Any],
    envs: list[dict[str, str]],
    run_dir: Path,
    token: str | None,
    name: str,
) -> list[Any]:
    """Start (not wait for) the ``dp`` replicas of one inference component on loopback ports."""
    from tandemrl.api.types import ParallelStrategy
    from tandemrl.inference.registry import get_backend
    from tandemrl.inference.server import launch_server

    backend = get_backend(comp.backend)
    per_server = ParallelStrategy(tp=comp.strategy.tp, pp=comp.strategy.pp)
    stem = f"{comp.backend}-{name}-server" if name else f"{comp.backend}-server"
    return [
        launch_server(
            backend,
            model_path,
            host="127.0.0.1",
            strategy=per_server,
            extra=extra,
            log_file=str(run_dir / f"{stem}-{i}.log"),
            env=envs[i],
            token=token,
            request_log=str(run_dir / f"{stem}-{i}-requests.jsonl") if token else None,
        )
        for i in range(comp.strategy.dp)
    ]


def start_env_server(spec: LaunchSpec, run_dir: Path, children: _Children, env: dict[str, str]) -> None:
    """Start the run's OpenEnv environment server (``openenv.app``) if it has one and wait for its health; its URL
    goes in the trainer's ``env`` (``TANDEMRL_OPENENV_URL``, unset without a server)."""
    from tandemrl.workflows.openenv import EnvServer

    env.pop(OPENENV_URL_ENV, None)
    if spec.env_server is None:
        return
    children.env_server = EnvServer(spec.env_server, log_file=str(run_dir / "openenv-server.log"))
    children.env_server.wait_healthy(spec.env_server.start_timeout)
    print(f"[launcher] openenv server healthy: {children.env_server.url} ({spec.env_server.app})", flush=True)
    env[OPENENV_URL_ENV] = str(children.env_server.url)


def run_trial(script: str, config_path: str | None, overrides: list[str], spec: LaunchSpec) -> TrialResult:
    """Start servers, run the trainer, stop everything; never leaves a process behind."""
    alloc = spec.allocation
    children = _Children()

    def body(run_dir: Path) -> tuple[int, str]:
        # fresh per run, never printed; running servers (rollout.server_addrs) keep the caller's
        token = new_token() if any("token" in c.features for c in [alloc.gen, *alloc.aux] if c) else None
        if spec.server_addrs and os.environ.get(TOKEN_ENV):
            token = os.environ[TOKEN_ENV]
        placement = plan_placement(alloc, visible_gpus(), visible_cpus())
        crowded = oversubscription(alloc, visible_gpus(), visible_cpus())
        if crowded:
            print(f"[launcher] warning: {crowded}", flush=True)
        env = dict(os.environ)
        start_env_server(spec, run_dir, children, env)  # first: an environment that fails costs no server start
        addrs = start_servers(spec, alloc, run_dir, children, token, placement)
        for key, value in placement.trainer_env.items():
            if key == "OMP_NUM_THREADS":
                env.setdefault(key, value)  # a user's thread count wins
            else:
                env[key] = value
        env[TRAINER_LOG_ENV] = str(run_dir / "trainer.log")
        env.pop(TOKEN_ENV, None)
        if token:
            env[TOKEN_ENV] = token
        if addrs:
            env[SERVER_ADDRS_ENV] = ",".join(addrs)
            _announce_servers(spec, env[SERVER_ADDRS_ENV])
        env.pop(AUX_SERVERS_ENV, None)
        if children.aux:
            table: dict[str, list[str]] = {}
            for name, server in children.aux:
                table.setdefault(name, []).append(server.address)
            env[AUX_SERVERS_ENV] = format_aux_addresses(table)
            print(f"[launcher] auxiliary servers healthy: {env[AUX_SERVERS_ENV]}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "tandemrl.launchers.torchrun_loopback",  # torchrun, its stores on 127.0.0.1 only
            "--standalone",
            f"--nproc_per_node={alloc.train_world_size}",
            *torchrun_log_args(run_dir),
        ]
        # The script's config lacks the launcher section (launcher.server_args is the launcher's).
        config, kept = script_config(config_path, overrides, str(run_dir / "config.yaml"))
        cmd += [script] + (["--config", config] if config else []) + kept
        print(f"[launcher] trainer: {' '.join(cmd)}", flush=True)
        children.trainer = subprocess.Popen(
            lifeline_command(cmd),  # torchrun and its ranks stop if the launcher is killed
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        started = time.time_ns()
        assert children.trainer.stdout is not None  # started with stdout=PIPE
        out = pump(children.trainer.stdout, "trainer", run_dir / "trainer.log")
        survivable = spec.weight_update_mode != "collective"
        trainer = children.trainer
        stalls = StallBounds(spec.launcher.server_stall_warn, spec.launcher.server_stall_limit)
        rc, lost = wait_trainer(
            trainer,
            children.servers,
            alloc.gen_backend or "",
            survivable,
            lambda: kill_group(trainer),
            children.aux,
            stalls,
        )
        out.join(timeout=10)
        if lost is not None:
            return rc, lost
        return rc, "" if rc == 0 else trainer_failure(run_dir, rc, started, out.first_error)

    result = guarded_trial(spec, overrides, body, children.stop)
    if result.returncode != 0 and children.trainer is not None:
        result.log = str(Path(result.run_dir) / "trainer.log")
    return result


def _announce_servers(spec: LaunchSpec, addrs: str) -> None:
    backend = spec.allocation.gen_backend
    if spec.server_addrs:
        print(f"[launcher] {backend} servers not started here (rollout.server_addrs): {addrs}", flush=True)
    else:
        print(f"[launcher] {backend} servers healthy at {addrs}", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv, "tandemrl.launchers.local", flags=("--multirun", dry_run.FLAG))
    specs = plan_trials(args)
    if dry_run.FLAG in args.flags or not specs:
        return 0
    return run_trials(args, specs, run_trial)


def cli() -> None:
    common.cli(main)


if __name__ == "__main__":
    cli()
