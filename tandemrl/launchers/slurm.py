"""Slurm launcher: write an sbatch script for one trial and submit it (``--wait``: and wait for it).

    python -m tandemrl.launchers.slurm SCRIPT --config YAML [key=value ...] [--dry-run] [--wait]
        [--partition P] [--gpus-per-node N] [--cpus-per-node N] [--time HH:MM:SS] [--account A]

Tested on a real one-node Slurm (Debian's slurm-wlm 22.05, ``tests/e2e/test_slurm_launcher.py``) with
CPU cores as the devices (``launcher.slurm.device=cpu``): GRPO through ``sbatch`` with the vLLM
server and the trainer in their own job steps (apart, and colocated until ``scancel``), and a
failing step. Multi-node jobs and GPU GRES (``device=gpu``, the default) are generated the same way
but have not run here.

Devices (``launcher.slurm.device``): ``gpu`` (default) allocates ``--gpus-per-node`` and gives each
step ``--gpus-per-task``; ``cpu`` makes one CPU core one ``allocation_mode`` device
(``--cpus-per-task`` everywhere, ``cpus_per_node`` cores per node), for CPU-only clusters.

Layout (from ``allocation_mode`` and the devices per node): inference servers on the first
nodes of the job, each server's tp*pp GPUs on one node, then the trainer nodes, with
min(train world, gpus_per_node) ranks per node; when the servers and the trainer fit one node
together, they share it (one node, each in its own job step). The job script starts every server with
``srun`` (``python -m tandemrl.launchers.serve``), waits until each has written its
address into the run directory (which must be on a filesystem shared by the nodes),
exports ``TANDEMRL_LLM_SERVER_ADDRS``, runs ``srun trainer.sh`` on the trainer nodes —
``torchrun --nnodes T --rdzv_backend c10d --rdzv_endpoint <first trainer node>:port`` —
and stops the servers when the trainer ends. A step that fails is written to
``RUN_DIR/job-<id>.failed`` (step, exit code, log), which ``--wait`` reports on one line.

Colocated (``|`` in ``allocation_mode``, ``launchers.placement``): no server nodes. Each server
runs on the trainer node of the ranks whose GPUs it shares, in an ``srun --overlap`` step that
sees all the node's GPUs, with ``CUDA_VISIBLE_DEVICES`` set to those ranks' local GPUs and the
plan's sleep-mode flags; the trainer step also runs with ``--overlap`` and sees every GPU of its
node (rank ``LOCAL_RANK`` uses ``cuda:LOCAL_RANK``), so the two agree on device numbers.

Settings, first found wins: the CLI flags, then ``launcher.slurm.<key>`` in the config or
overrides (``device``, ``partition``, ``gpus_per_node``, ``cpus_per_node``, ``time``, ``account``,
``server_port``, ``rdzv_port``, ``sbatch_args``: extra ``#SBATCH`` arguments; typed and defaulted in
``tandemrl.configs.launcher``: 8 GPUs per node unless told).
The trainer sees the config without the ``launcher`` section (the script's schema does
not know it) plus ``cluster.n_nodes``/``cluster.n_gpus_per_node`` of the job. Sweeps
(``--multirun``) are not supported here: submit one job per value. ``--dry-run`` writes the job
files and prints the batch arithmetic and resolved config (``dry_run``), but does not submit.
``--wait`` follows the job until it ends (``slurm_job``): exit 0 if it completed, else one line
naming the failed step and its log; Ctrl-C/SIGTERM cancels the job.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.inference.remote import SERVER_ADDRS_ENV
from tandemrl.inference.server_auth import TOKEN_ENV
from tandemrl.launchers import common, dry_run, slurm_job
from tandemrl.launchers.launch_config import LaunchSpec, script_config
from tandemrl.launchers.placement import RankSlot, is_colocated, plan_colocated

OPTIONS = ("--partition", "--gpus-per-node", "--cpus-per-node", "--time", "--account")
WAIT = "--wait"
# Launcher environment the job script re-exports (sbatch also copies the submitter's env).
FORWARD_PREFIXES = ("TANDEMRL_", "WANDB_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHONPATH", "NCCL_", "GLOO_")


@dataclass
class SlurmSettings:
    """Job resources and ports for one trial."""

    devices_per_node: int  # GPUs per node; with device "cpu", cores per node
    device: str  # what one allocation_mode device is: a GPU (GRES), or one CPU core (launcher.slurm.device)
    partition: str | None
    time: str | None
    account: str | None
    server_port: int  # first server port on a node; the next server there gets +1
    rdzv_port: int
    sbatch_args: list[str]

    @property
    def per_node_key(self) -> str:
        return f"{self.device}s_per_node"

    def per_task(self, n: int | str) -> str:
        """The srun option giving a step's task ``n`` devices."""
        return f"--{self.device}s-per-task={n}"


@dataclass
class Layout:
    """Where every process goes: server nodes first, then trainer nodes (colocated: trainer nodes only)."""

    server_nodes: int
    servers_per_node: int
    gpus_per_server: int
    n_servers: int
    trainer_nodes: int
    procs_per_node: int
    colocated: bool = False
    server_devices: list[str] = field(default_factory=list)  # colocated: each server's devices (server_env_key)
    server_env_key: str = "CUDA_VISIBLE_DEVICES"  # colocated on CPU cores: VLLM_CPU_OMP_THREADS_BIND
    server_flags: dict[str, Any] = field(default_factory=dict)  # colocated: sleep mode and memory share
    trainer_threads: int = 1  # a trainer rank's OMP_NUM_THREADS unless the user set one
    packed: bool = False  # apart ('+') and everything fits one node: servers and trainer share it, own steps

    @property
    def nodes(self) -> int:
        return self.server_nodes + self.trainer_nodes


def read_settings(spec: LaunchSpec, options: dict[str, str]) -> SlurmSettings:
    """CLI flags over ``launcher.slurm.*``; errors name the flag."""
    section = spec.launcher.slurm

    def as_int(value: str, flag: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{flag} must be an integer, got {value!r}") from None

    count: int | None
    if section.device == "gpu":
        flag, count = "--gpus-per-node", section.gpus_per_node
    else:
        flag, count = "--cpus-per-node", section.cpus_per_node
    if flag in options:
        count = as_int(options[flag], flag)
    if count is None:
        raise ValueError("launcher.slurm.device=cpu needs launcher.slurm.cpus_per_node (cores per node, one a device)")
    if count < 1:
        raise ValueError(f"{flag} must be >= 1 for the slurm launcher, got {count}")
    return SlurmSettings(
        devices_per_node=count,
        device=section.device,
        partition=_opt_str(options.get("--partition", section.partition)),
        time=_opt_str(options.get("--time", section.time)),
        account=_opt_str(options.get("--account", section.account)),
        server_port=section.server_port,
        rdzv_port=section.rdzv_port,
        sbatch_args=list(section.sbatch_args),
    )


def _opt_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def plan_layout(spec: LaunchSpec, settings: SlurmSettings) -> Layout:
    """Node counts for ``spec``'s allocation; one-line errors for shapes that do not fit."""
    alloc, per_node_devices, key = spec.allocation, settings.devices_per_node, settings.per_node_key
    gen, world = alloc.gen, alloc.train_world_size
    per_server = gen.strategy.tp * gen.strategy.pp if gen else 0
    n_servers = gen.strategy.dp if gen else 0
    if gen is not None and per_server > per_node_devices:
        raise ValueError(f"one {gen.backend} server needs tp*pp={per_server} devices but {key} is {per_node_devices}")
    if world > per_node_devices and world % per_node_devices:
        raise ValueError(f"train world size {world} is not a multiple of {key} {per_node_devices}")
    if is_colocated(alloc):
        return _colocated_layout(spec, settings)
    if n_servers and n_servers * per_server + world <= per_node_devices:  # one node, every process in its own step
        return Layout(0, n_servers, per_server, n_servers, 1, world, packed=True)
    per_node = per_node_devices // per_server if per_server else 0
    return Layout(
        server_nodes=math.ceil(n_servers / per_node) if n_servers else 0,
        servers_per_node=per_node,
        gpus_per_server=per_server,
        n_servers=n_servers,
        trainer_nodes=math.ceil(world / per_node_devices),
        procs_per_node=min(world, per_node_devices),
    )


def _colocated_layout(spec: LaunchSpec, settings: SlurmSettings) -> Layout:
    """Servers on the trainer nodes, each sharing tp*pp ranks' devices (``plan_colocated``).

    On GPUs a server gets its ranks' GPUs (CUDA_VISIBLE_DEVICES); on CPU cores (device "cpu") the
    one-machine plan: the servers bind the node's cores between them, the ranks share its threads.
    """
    alloc = spec.allocation
    assert alloc.gen is not None
    world, per_server = alloc.train_world_size, alloc.gen.strategy.tp * alloc.gen.strategy.pp
    per_node = min(world, settings.devices_per_node)
    cores = list(range(settings.devices_per_node)) if settings.device == "cpu" else []
    # Rank r: node r // per_node, local device r % per_node (the trainer step sees the node's devices in order).
    plan = plan_colocated(
        alloc, [RankSlot(str(r // per_node), [] if cores else [str(r % per_node)], cores) for r in range(world)]
    )
    key = "VLLM_CPU_OMP_THREADS_BIND" if cores else "CUDA_VISIBLE_DEVICES"
    threads = int(next(iter(plan.trainer_env.values())).get("OMP_NUM_THREADS", "1"))
    return Layout(
        server_nodes=0,
        servers_per_node=per_node // per_server,
        gpus_per_server=per_server,
        n_servers=alloc.gen.strategy.dp,
        trainer_nodes=math.ceil(world / settings.devices_per_node),
        procs_per_node=per_node,
        colocated=True,
        server_devices=[share.env[key] for share in plan.servers],
        server_env_key=key,
        server_flags=plan.server_flags,
        trainer_threads=threads,
    )


def _q(value: object) -> str:
    return shlex.quote(str(value))


def trainer_args(script: str, config: str | None, overrides: list[str], layout: Layout, gpus: int) -> list[str]:
    """SCRIPT and its arguments: the config the script may read, user overrides, the job's shape."""
    args = [os.path.abspath(script)] + (["--config", config] if config else [])
    args += [o for o in overrides if not o.lstrip("+").startswith("launcher.")]
    # The job's node count: n_nodes > 1 tells the trainer its weight-update peers are not on loopback.
    return args + [f"cluster.n_nodes={layout.nodes}", f"cluster.n_gpus_per_node={gpus}"]


def trainer_script(args: list[str], layout: Layout, settings: SlurmSettings, run_dir: Path) -> str:
    """One trainer node's part; srun runs it once per trainer node (c10d joins them).

    Needs SLURM_JOB_ID and TANDEMRL_RDZV_HOST (the first trainer node) in the environment. Each rank's
    error goes to torchrun's error file under the run dir, which ``--wait`` reports.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={layout.trainer_nodes}"]
    torchrun += [f"--nproc_per_node={layout.procs_per_node}", "--rdzv_backend=c10d", "--max_restarts=0"]
    torchrun += common.torchrun_log_args(run_dir)
    rdzv = f'--rdzv_endpoint="${{TANDEMRL_RDZV_HOST}}:{settings.rdzv_port}" --rdzv_id="${{SLURM_JOB_ID}}"'
    cmd = " ".join(_q(a) for a in torchrun) + f" {rdzv} " + " ".join(_q(a) for a in args)
    return (
        "#!/bin/bash\n"
        "# One trainer node: torchrun joins the others through c10d on the first trainer node.\n"
        "set -euo pipefail\n"
        f"cd {_q(os.getcwd())}\n"
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{layout.trainer_threads}}}"\n'
        f"exec {cmd}\n"
    )


def job_script(spec: LaunchSpec, settings: SlurmSettings, layout: Layout, run_dir: Path) -> str:
    """The sbatch script: header, servers via srun, wait for health, srun the trainer nodes."""
    gen = spec.allocation.gen
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_q(spec.experiment_name + '_' + spec.trial_name)}",
        f"#SBATCH --nodes={layout.nodes}",
        "#SBATCH --ntasks-per-node=1",
        # device "cpu": the job's one task per node holds the node's cores
        f"#SBATCH --{'gpus-per-node' if settings.device == 'gpu' else 'cpus-per-task'}={settings.devices_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={_q(run_dir / 'slurm-%j.out')}",
    ]
    header += [f"#SBATCH --{k}={_q(v)}" for k, v in (("partition", settings.partition), ("time", settings.time)) if v]
    header += [f"#SBATCH --account={_q(settings.account)}"] if settings.account else []
    header += [f"#SBATCH {a}" for a in settings.sbatch_args]
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES) and k != TOKEN_ENV}
    lines = [
        *header,
        "# Generated by tandemrl.launchers.slurm.",
        "set -euo pipefail",
        f"cd {_q(os.getcwd())}",
        *(f"export {k}={_q(v)}" for k, v in sorted(env.items())),
        f"RUN_DIR={_q(run_dir)}",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'TRAINER_NODES=("${{NODES[@]:{layout.server_nodes}:{layout.trainer_nodes}}}")',
        'export TANDEMRL_RDZV_HOST="${TRAINER_NODES[0]}"',
        "SERVER_STEPS=()",
        'stop_servers() { for p in "${SERVER_STEPS[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }',
        "trap stop_servers EXIT",
        f'FAILED="$RUN_DIR/{slurm_job.FAILED_FILE.format(job="$SLURM_JOB_ID")}"',
        "# fail STEP WHAT LOG: the job's first failed step, for `--wait` (one tab-separated line), then exit 1",
        "fail() {",
        '  [ -e "$FAILED" ] || printf "%s\\t%s\\t%s\\n" "$1" "$2" "$3" > "$FAILED"',
        '  echo "error: $1 step $2 (log: $3)" >&2',
        "  exit 1",
        "}",
    ]
    if gen is not None:
        lines += _server_lines(spec, settings, layout)
    trainer_nodes = '"$(IFS=,; echo "${TRAINER_NODES[*]}")"'
    # Colocated: the trainer shares its node's devices with the servers' steps.
    share = f"{settings.devices_per_node} --overlap" if layout.colocated else f"{layout.procs_per_node} --exact"
    lines += [
        f"srun --job-name=trainer --nodes={layout.trainer_nodes} --ntasks-per-node=1 --nodelist={trainer_nodes} "
        f"{settings.per_task(share)} --kill-on-bad-exit=1 \\",
        '  bash "$RUN_DIR/trainer.sh" 2>&1 | tee -a "$RUN_DIR/trainer.log" \\',
        '  || fail trainer "exited with code $?" "$RUN_DIR/trainer.log"',
    ]
    return "\n".join(lines) + "\n"


def _server_lines(spec: LaunchSpec, settings: SlurmSettings, layout: Layout) -> list[str]:
    """Start every server with srun, wait until each published its address, export them."""
    gen = spec.allocation.gen
    assert gen is not None
    serve = [sys.executable, "-m", "tandemrl.launchers.serve", "--backend", gen.backend, "--model", spec.model_path]
    serve += ["--tp", str(gen.strategy.tp), "--pp", str(gen.strategy.pp), "--timeout", str(spec.server_timeout)]
    extra = {**layout.server_flags, **spec.server_extra}
    serve += ["--extra", json.dumps(extra, sort_keys=True)] if extra else []
    lines = []
    request_log = ""
    if "token" in gen.features:  # servers listen on node names: a fresh token per job, never in a file
        lines.append(
            f'export {TOKEN_ENV}="$({_q(sys.executable)} -c "import secrets; print(secrets.token_urlsafe(32))")"'
        )
    if "middleware" in gen.features:
        request_log = f' --request-log "$RUN_DIR/{gen.backend}-server-$i-requests.jsonl"'
    if layout.colocated:  # on the trainer nodes, sharing their ranks' devices (all the node's devices in the step)
        lines += [
            'SERVER_NODES=("${TRAINER_NODES[@]}")',
            f"SERVER_DEVICES=({' '.join(map(_q, layout.server_devices))})",
        ]
        step = f"--overlap {settings.per_task(settings.devices_per_node)}"
        cmd = f'env {layout.server_env_key}="${{SERVER_DEVICES[$i]}}" ' + " ".join(_q(a) for a in serve)
    else:  # their own nodes, or (packed) the trainer's node, in steps of their own devices
        nodes = "${TRAINER_NODES[@]}" if layout.packed else f"${{NODES[@]:0:{layout.server_nodes}}}"
        lines.append(f'SERVER_NODES=("{nodes}")')
        step = f"{settings.per_task(layout.gpus_per_server)} --exact"
        cmd = " ".join(_q(a) for a in serve)
    log = f"$RUN_DIR/{gen.backend}-server-$i.log"
    return lines + [
        'rm -rf "$RUN_DIR/servers" && mkdir -p "$RUN_DIR/servers"',
        f"for i in $(seq 0 {layout.n_servers - 1}); do",
        f'  node="${{SERVER_NODES[$((i / {layout.servers_per_node}))]}}"',
        f"  port=$(({settings.server_port} + i % {layout.servers_per_node}))",
        f'  srun --job-name="{gen.backend}-server-$i" --nodes=1 --ntasks=1 --nodelist="$node" {step} \\',
        f"    {cmd} \\",
        f'    --host "$node" --port "$port" --log "{log}" --ready "$RUN_DIR/servers/$i.addr"{request_log} \\',
        f"    --stall-warn {spec.launcher.server_stall_warn:g} --stall-limit {spec.launcher.server_stall_limit:g} "
        f'--step "{gen.backend}-server-$i" --failed "$FAILED" &',
        "  SERVER_STEPS+=($!)",
        "done",
        f"deadline=$((SECONDS + {int(spec.server_timeout) + 60}))",
        f'until [ "$(ls "$RUN_DIR"/servers/*.addr 2>/dev/null | wc -l)" -ge {layout.n_servers} ]; do',
        '  for i in "${!SERVER_STEPS[@]}"; do',
        '    if ! kill -0 "${SERVER_STEPS[$i]}" 2>/dev/null; then',
        '      rc=0; wait "${SERVER_STEPS[$i]}" || rc=$?',
        f'      fail "{gen.backend}-server-$i" "exited with code $rc before it was healthy" "{log}"',
        "    fi",
        "  done",
        '  [ "$SECONDS" -lt "$deadline" ] || fail servers '
        f'"not healthy in {int(spec.server_timeout) + 60} s" "$RUN_DIR/{gen.backend}-server-0.log"',
        "  sleep 2",
        "done",
        f'export {SERVER_ADDRS_ENV}="$(for i in $(seq 0 {layout.n_servers - 1}); do '
        'cat "$RUN_DIR/servers/$i.addr"; done | paste -sd, -)"',
        f'echo "[launcher] {gen.backend} servers healthy at ${SERVER_ADDRS_ENV}"',
    ]


def write_job(
    script: str, config_path: str | None, overrides: list[str], spec: LaunchSpec, settings: SlurmSettings
) -> Path:
    """Write ``job.sbatch`` and ``trainer.sh`` (and a launcher-free config) into the run dir."""
    layout = plan_layout(spec, settings)  # a shape that does not fit writes nothing
    run_dir = Path(spec.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = _trainer_config(config_path, run_dir)
    (run_dir / "trainer.sh").write_text(
        trainer_script(
            trainer_args(script, config, overrides, layout, settings.devices_per_node), layout, settings, run_dir
        )
    )
    job = run_dir / "job.sbatch"
    job.write_text(job_script(spec, settings, layout, run_dir))
    return job


def _trainer_config(config_path: str | None, run_dir: Path) -> str | None:
    """The config the trainer reads: the user's file, or a copy without ``launcher`` if it has one."""
    return script_config(config_path, [], str(run_dir / "config.yaml"))[0]


def main(argv: list[str]) -> int:
    flags = (dry_run.FLAG, WAIT)
    args = common.parse_args(argv, "tandemrl.launchers.slurm", flags=flags, options=OPTIONS)
    specs = common.plan_trials(args)
    if not specs:  # finished already (said)
        return 0
    common.refuse_local_only(specs, "slurm")
    if any(o in ("--multirun", "-m") for o in args.overrides):
        raise ValueError("the slurm launcher submits one trial: run one launcher call per sweep value")
    overrides, spec = specs[0]
    settings = read_settings(spec, args.options)
    job = write_job(args.script, args.config_path, overrides, spec, settings)
    print(f"[launcher] wrote {job} ({plan_layout(spec, settings).nodes} nodes)", flush=True)
    if dry_run.FLAG in args.flags:  # the job is written, not submitted
        return 0
    if WAIT in args.flags:
        return common.run_trials(args, specs, lambda *_: slurm_job.run_job(job, spec, overrides))
    print(f"[launcher] Submitted batch job {slurm_job.submit(job)}", flush=True)
    return 0


def cli() -> None:
    common.cli(main)


if __name__ == "__main__":
    cli()
