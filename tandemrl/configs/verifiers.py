"""Config of a verifiers environment run as tandemrl episodes (docs/environments.md, "verifiers")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandemrl.configs.agent import AgentGRPOConfig

DEFAULT_PYTHON = ".venv-verifiers/bin/python"


@dataclass
class VerifiersConfig:
    """Which verifiers environment runs the episodes, and the python that has it installed."""

    env: str = field(
        default="",
        metadata={"help": "The environment's taskset id, as `vf eval` takes it: a module or package name."},
    )
    taskset_args: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Fields of the taskset's config, e.g. {split: train}."}
    )
    harness: str = field(
        default="null",
        metadata={"help": "The verifiers harness that runs the model: 'null' is a chat loop (with the task's tools)."},
    )
    runtime: str = field(
        default="subprocess",
        metadata={"help": "Where the harness program runs (verifiers' runtime type); 'subprocess': this machine."},
    )
    python: str = field(
        default=DEFAULT_PYTHON,
        metadata={
            "help": "Python of the virtualenv that has verifiers and the environment installed (verifiers needs "
            "openai<3): python -m tandemrl.workflows.verifiers setup [PACKAGES] builds .venv-verifiers."
        },
    )
    paths: list[str] = field(
        default_factory=list, metadata={"help": "Directories put first on the environment process's sys.path."}
    )
    test_size: int = field(
        default=0,
        metadata={"help": "Tasks held out as the test split (a seeded sample; the rest is train).", "min": 0},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the held-out sample."})


@dataclass
class VerifiersGRPOConfig(AgentGRPOConfig):
    """GRPO on a verifiers environment's episodes (``examples/verifiers_grpo.py``): its tasks are the dataset
    rows (written to ``train_dataset.path``), its rubric the reward."""

    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
