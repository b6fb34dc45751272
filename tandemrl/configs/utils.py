"""Configs of the run-level utilities: saving, evaluation, recovery, logging."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FreqConfig:
    """When a periodic action fires; any condition that is set triggers it."""

    freq_epochs: int | None = field(default=None, metadata={"help": "Every N epochs.", "min": 1})
    freq_steps: int | None = field(default=None, metadata={"help": "Every N global steps.", "min": 1})
    freq_secs: int | None = field(default=None, metadata={"help": "Every N seconds of wall time.", "min": 1})


@dataclass
class SaverConfig(FreqConfig):
    """HF-format checkpoints written during training."""

    save_final: bool = field(
        default=True,
        metadata={"help": "Also save after the last training step, whatever freq_* says (the trained model)."},
    )

    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    fileroot: str = field(default="${cluster.fileroot}", metadata={"help": "Root directory of run outputs."})


@dataclass
class RecoverConfig(FreqConfig):
    """Recoverable (model + optimizer + dataloader) checkpoints for resuming a crashed run."""

    mode: str = field(
        default="disabled",
        metadata={
            "help": "disabled: never save or resume; auto: save every freq_*, resume if a checkpoint exists; "
            "resume: like auto, but a missing checkpoint is an error.",
            "choices": ["disabled", "auto", "resume"],
        },
    )
    keep_previous: bool = field(
        default=True,
        metadata={
            "help": "Keep the checkpoint a new one replaces as recover.prev: a newest checkpoint found corrupt at "
            "start (a truncated or changed file) is named in one line and the run resumes from recover.prev. "
            "Costs the disk of a second checkpoint."
        },
    )
    save_final: bool = field(
        default=True,
        metadata={"help": "When mode is not disabled, also save after the last training step, whatever freq_* says."},
    )
    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    fileroot: str = field(default="${cluster.fileroot}", metadata={"help": "Root directory of run outputs."})


@dataclass
class EvaluatorConfig(FreqConfig):
    """Periodic evaluation on the validation set."""

    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    fileroot: str = field(default="${cluster.fileroot}", metadata={"help": "Root directory of run outputs."})


@dataclass
class HeldoutEvalConfig:
    """Greedy accuracy of the served policy on a fixed held-out slice, before the first step and after the last."""

    n: int = field(
        default=0,
        metadata={
            "help": "Questions scored: the first n rows of `split` (GSM8K-style jsonl); 0 turns it off.",
            "min": 0,
        },
    )
    path: str = field(default="${train_dataset.path}", metadata={"help": "Directory holding <split>.jsonl."})
    split: str = field(default="test", metadata={"help": "File stem of the held-out split."})
    max_new_tokens: int = field(default=256, metadata={"help": "Greedy generation budget per question.", "min": 1})
    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    fileroot: str = field(
        default="${cluster.fileroot}",
        metadata={"help": "Reports go to <fileroot>/logs/<experiment>/<trial>/heldout_{before,after}.json."},
    )


@dataclass
class WandBConfig:
    """Weights & Biases logging."""

    mode: str = field(
        default="disabled",
        metadata={"help": "online, offline or disabled.", "choices": ["online", "offline", "disabled"]},
    )
    project: str | None = field(default=None, metadata={"help": "Project; None uses experiment_name."})
    entity: str | None = field(default=None, metadata={"help": "Team or user."})
    name: str | None = field(default=None, metadata={"help": "Run name; None uses trial_name."})
    tags: list[str] | None = field(default=None, metadata={"help": "Run tags."})


@dataclass
class TensorBoardConfig:
    """TensorBoard event files."""

    path: str | None = field(default=None, metadata={"help": "Log directory; None disables TensorBoard."})


@dataclass
class StatsLoggerConfig:
    """Where committed statistics go (rank 0 only)."""

    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    fileroot: str = field(default="${cluster.fileroot}", metadata={"help": "Root directory of run outputs."})
    wandb: WandBConfig = field(default_factory=WandBConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    console: bool = field(default=True, metadata={"help": "Print a table of statistics at each commit."})
    jsonl: bool = field(
        default=True,
        metadata={
            "help": 'Append each commit as one JSON line {"step": global step + 1, stat: value, ...} to '
            "<fileroot>/logs/<experiment>/<trial>/stats.jsonl."
        },
    )
    plot: bool = field(
        default=True,
        metadata={
            "help": "When the run ends, draw curves.png next to stats.jsonl (reward, eval accuracy, response "
            "length, KL and train/inference mismatch per step; needs jsonl) and print its path."
        },
    )
    prompt_ids: bool = field(
        default=False,
        metadata={
            "help": "Append each RL step's trained prompt ids (the rows' 'id' field) and those taken from the "
            "dataloader but not yet trained to <fileroot>/logs/<experiment>/<trial>/prompt_ids.jsonl."
        },
    )


@dataclass
class RunNameConfig:
    """The run directory's names, ``<cluster.fileroot>/logs/<experiment_name>/<trial_name>``: one default for
    every root config, so a launcher (which reads them without the script's schema) and the script agree."""

    experiment_name: str = field(default="tandemrl", metadata={"help": "Groups trials; names output folders."})
    trial_name: str = field(default="trial0", metadata={"help": "One run of an experiment."})


@dataclass
class ClusterConfig:
    """Where outputs go and how processes find each other."""

    fileroot: str = field(default="./runs", metadata={"help": "Root directory of all run outputs."})
    n_nodes: int = field(default=1, metadata={"help": "Number of nodes.", "min": 1})
    n_gpus_per_node: int = field(
        default=2, metadata={"help": "Devices (GPUs, or CPU processes here) per node.", "min": 1}
    )


# Where a run's checkpoints go, and the recoverable one's loop state (written by tandemrl.trainers.recover).
RECOVER_DIR = "recover"
LOOP_STATE_FILE = "loop_state.json"


def save_root(fileroot: str, experiment_name: str, trial_name: str) -> str:
    """``<fileroot>/checkpoints/<experiment>/<trial>``: the run's HF models and its recoverable checkpoint."""
    return os.path.join(fileroot, "checkpoints", experiment_name, trial_name)


def finished_run(fileroot: str, experiment_name: str, trial_name: str, length: dict[str, Any]) -> dict[str, Any] | None:
    """The loop state of the run's recoverable checkpoint when it marks the run finished (its last step saved)
    under the same ``length`` (``total_train_steps`` / ``total_train_epochs``: a longer run goes on), else None
    (no checkpoint, an unfinished or unreadable one: the trainer's own recovery decides then)."""
    path = os.path.join(save_root(fileroot, experiment_name, trial_name), RECOVER_DIR, LOOP_STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("finished") is not True or state.get("length") != length:
        return None
    return state
