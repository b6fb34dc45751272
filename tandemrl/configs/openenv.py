"""Config of an OpenEnv environment run as tandemrl episodes (docs/environments.md, "OpenEnv")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandemrl.configs.agent import AgentGRPOConfig

DEFAULT_PYTHON = ".venv-openenv/bin/python"


@dataclass
class OpenEnvConfig:
    """Which OpenEnv environment server runs the episodes, and how the model's text meets its actions."""

    app: str = field(
        default="",
        metadata={
            "help": "The environment server's app as uvicorn takes it ('module:app', built with openenv's "
            "create_app); the launcher starts it with `python` and stops it. Empty: `url` names a running one."
        },
    )
    url: str = field(default="", metadata={"help": "A running environment server's base URL (http://host:port)."})
    python: str = field(
        default=DEFAULT_PYTHON,
        metadata={
            "help": "Python of the virtualenv that has openenv and the environment installed: "
            "python -m tandemrl.workflows.openenv setup [PACKAGES] builds .venv-openenv."
        },
    )
    paths: list[str] = field(
        default_factory=list, metadata={"help": "Directories put first on the environment server's sys.path."}
    )
    action_field: str = field(
        default="message", metadata={"help": "The action's field that the model's reply fills (a text action)."}
    )
    observation_field: str = field(
        default="",
        metadata={"help": "The observation's field shown to the model; empty: the observation as JSON."},
    )
    system_prompt: str = field(default="", metadata={"help": "A system message before the first observation."})
    max_turns: int = field(default=4, metadata={"help": "Model replies per episode at most.", "min": 1})
    reset_args: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Keyword arguments of every reset, besides the row's seed."}
    )
    train_size: int = field(default=1024, metadata={"help": "Training rows: reset seeds 0 .. train_size-1.", "min": 1})
    test_size: int = field(
        default=0,
        metadata={"help": "Held-out rows: the next test_size seeds, so no seed is in both splits.", "min": 0},
    )
    start_timeout: float = field(
        default=120.0, metadata={"help": "Seconds the environment server may take to answer /health.", "min": 1}
    )


@dataclass
class OpenEnvGRPOConfig(AgentGRPOConfig):
    """GRPO on an OpenEnv environment's episodes (``examples/openenv_grpo.py``): each row is a reset seed
    (written to ``train_dataset.path``), the environment's step rewards are the rewards."""

    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
