"""The ``launcher`` section: settings of the launchers themselves, which training scripts never see.

Read with the rest of a run's config by the same typed loader (``configs.loader.read_known_keys``,
the launchers' ``LaunchView``): each key has one type and one default, here; an unknown key or a
bad value is one line naming it, before any process starts. The launchers strip the section from
the config their scripts get (``launchers.launch_config.script_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SlurmLauncherConfig:
    """``launcher.slurm.*``: the job the Slurm launcher writes (its CLI flags win over these)."""

    device: str = field(
        default="gpu",
        metadata={
            "help": "What an allocation_mode device is: 'gpu' (GRES) or 'cpu' (one core; needs cpus_per_node).",
            "choices": ["gpu", "cpu"],
        },
    )
    gpus_per_node: int = field(
        default=8,
        metadata={
            "help": "GPUs per node of the cluster (--gpus-per-node); the job passes it to the trainer as "
            "cluster.n_gpus_per_node.",
            "min": 1,
        },
    )
    cpus_per_node: int | None = field(
        default=None, metadata={"help": "Cores per node when device=cpu (--cpus-per-node).", "min": 1}
    )
    partition: str | None = field(default=None, metadata={"help": "#SBATCH --partition (--partition)."})
    time: str | None = field(default=None, metadata={"help": "#SBATCH --time, e.g. 04:00:00 (--time)."})
    account: str | None = field(default=None, metadata={"help": "#SBATCH --account (--account)."})
    server_port: int = field(
        default=8000, metadata={"help": "Port of each inference server on its node.", "min": 1, "max": 65535}
    )
    rdzv_port: int = field(
        default=29500,
        metadata={"help": "torchrun's rendezvous port on the first trainer node.", "min": 1, "max": 65535},
    )
    sbatch_args: list[str] = field(
        default_factory=list, metadata={"help": "Extra #SBATCH lines' arguments, e.g. ['--qos=high']."}
    )


@dataclass
class RayLauncherConfig:
    """``launcher.ray.*``: which Ray nodes hold the servers and the trainer ranks (custom resources)."""

    server_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={"help": "Custom Ray resources each inference server asks for, e.g. {rollout: 1}."},
    )
    trainer_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={"help": "Custom Ray resources each trainer rank asks for, e.g. {train: 1}."},
    )


@dataclass
class LauncherConfig:
    """``launcher.*``: what every launcher reads of its own."""

    server_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Extra flags of the generation servers in the backend's own option names, e.g. "
            "{max_num_seqs: 64} (over the placement's flags; the ones tandemrl sets itself are refused)."
        },
    )
    server_stall_warn: float = field(
        default=60.0, metadata={"help": "Seconds a live server may not answer before it is reported.", "gt": 0.0}
    )
    server_stall_limit: float = field(
        default=900.0,
        metadata={
            "help": "Seconds a live server may not answer before the run stops (> server_stall_warn).",
            "gt": 0.0,
        },
    )
    slurm: SlurmLauncherConfig = field(default_factory=SlurmLauncherConfig)
    ray: RayLauncherConfig = field(default_factory=RayLauncherConfig)


def launcher_problem(section: LauncherConfig) -> tuple[str, str] | None:
    """(key, message) for values of the section that do not fit together, else None."""
    if section.server_stall_warn >= section.server_stall_limit:
        return (
            "launcher.server_stall_warn",
            f"({section.server_stall_warn:g}) must be below launcher.server_stall_limit "
            f"({section.server_stall_limit:g}): 0 < warn < limit",
        )
    return None
