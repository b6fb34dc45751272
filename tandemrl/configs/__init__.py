"""Structured configs (dataclasses) and their YAML/CLI loader."""

from typing import TYPE_CHECKING

from tandemrl.api.renamed import retired_names
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.distill import DistillActorConfig, DistillConfig
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.experiment import BaseExperimentConfig, GRPOConfig, PPOConfig, SFTConfig
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.configs.utils import (
    ClusterConfig,
    EvaluatorConfig,
    HeldoutEvalConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
    TensorBoardConfig,
    WandBConfig,
)

__all__ = [
    "BaseExperimentConfig",
    "ClusterConfig",
    "DatasetConfig",
    "DistillActorConfig",
    "DistillConfig",
    "EvaluatorConfig",
    "HeldoutEvalConfig",
    "GRPOConfig",
    "GenerationHyperparameters",
    "InferenceClientConfig",
    "MicroBatchSpec",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "PPOConfig",
    "RecoverConfig",
    "SFTConfig",
    "SaverConfig",
    "StatsLoggerConfig",
    "TensorBoardConfig",
    "TrainEngineConfig",
    "WandBConfig",
]

from tandemrl.configs.loader import (  # noqa: E402
    ConfigError,
    config_to_dict,
    exit_on_config_error,
    read_config,
    register_configs,
    save_config,
)

__all__ += [
    "ConfigError",
    "config_to_dict",
    "exit_on_config_error",
    "read_config",
    "register_configs",
    "save_config",
]

if not TYPE_CHECKING:  # old names fail with the line naming the new one (tandemrl.api.renamed)
    __getattr__ = retired_names(__name__)
