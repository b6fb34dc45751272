"""Root configs of the shipped experiments; each component reads only its own sub-config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.configs.services import AuxServerConfig, RewardServiceConfig
from tandemrl.configs.utils import (
    ClusterConfig,
    EvaluatorConfig,
    HeldoutEvalConfig,
    RecoverConfig,
    RunNameConfig,
    SaverConfig,
    StatsLoggerConfig,
)

if TYPE_CHECKING:
    from tandemrl.api.allocation import AllocationMode


@dataclass
class BaseExperimentConfig(RunNameConfig):
    """Fields every experiment has."""

    allocation_mode: str = field(default="fsdp:d2", metadata={"help": "Devices and parallelism, e.g. vllm:d1+fsdp:d1."})
    seed: int = field(default=1, metadata={"help": "Global seed."})
    deterministic: bool = field(
        default=False,
        metadata={
            "help": "Bitwise-reproducible runs on one machine: deterministic torch algorithms on every rank, "
            "per-request sampling seeds derived from (seed, rollout, prompt id, sample), rollouts consumed in "
            "submission order, and (async) every batch generated whole by one weight version (a weight update "
            "waits for running rollouts instead of interrupting them). See docs/determinism.md."
        },
    )
    total_train_epochs: int = field(default=1, metadata={"help": "Epochs over the train set.", "min": 1})
    total_train_steps: int | None = field(
        default=None, metadata={"help": "Stop after this many steps if set.", "min": 1}
    )
    tokenizer_path: str = field(default="", metadata={"help": "Tokenizer directory; empty uses the model's."})
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig | None = field(default=None)
    saver: SaverConfig = field(default_factory=SaverConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)

    @property
    def allocation(self) -> AllocationMode:
        """``allocation_mode`` parsed (``configs.backends.parse_allocation``), on each read: the value follows the
        string. The loader has refused a config whose string does not parse."""
        return parse_allocation(self.allocation_mode)


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning."""

    model: TrainEngineConfig = field(default_factory=TrainEngineConfig)


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO and its critic-free variants."""

    async_training: bool | None = field(
        default=None,
        metadata={
            "help": "Overlap rollout and training (prepare_batch); null: when rollout.max_head_offpolicyness > 0. "
            "true with max_head_offpolicyness 0 is a config error: no sample may lag, so nothing can overlap."
        },
    )
    weight_update_mode: str = field(
        default="collective",
        metadata={"help": "How new weights reach the servers.", "choices": ["collective", "disk"]},
    )
    weight_update_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Collective updates only: cast floating-point weights to this dtype before sending (bfloat16 "
            "halves the bytes of an fp32 trainer and is what a bf16 server keeps); null sends them as trained.",
            "choices": ["bfloat16", "float16", "float32"],
        },
    )
    weight_update_delta: str = field(
        default="none",
        metadata={
            "help": "Collective updates only: send each weight bucket whole ('none') or as its change since the "
            "last update, as a bitmask plus XORed 16-bit words ('xor') or as indices plus new words ('sparse'); "
            "each bucket is checksummed on the server. See bench/README.md (weight_sync.py) for when it pays.",
            "choices": ["none", "xor", "sparse"],
        },
    )
    weight_update_anchor_every: int = field(
        default=10,
        metadata={"help": "With weight_update_delta: send every N-th update whole (an anchor).", "min": 1},
    )
    warn_no_signal_steps: int = field(
        default=3,
        metadata={
            "help": "Warn once when this many steps in a row carried no learning signal (every advantage 0, or "
            "grad_norm 0): no group had samples with different rewards, so the model does not change. The "
            "closing line counts such steps either way. 0 turns the warning off.",
            "min": 0,
        },
    )
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rollout: InferenceClientConfig = field(default_factory=InferenceClientConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    ref: TrainEngineConfig | None = field(
        default=None, metadata={"help": "Frozen reference model for the KL term (path empty = actor's)."}
    )
    heldout_eval: HeldoutEvalConfig = field(default_factory=HeldoutEvalConfig)
    aux_servers: dict[str, AuxServerConfig] = field(
        default_factory=dict,
        metadata={"help": "Auxiliary inference servers by allocation_mode name (vllm[judge] -> aux_servers.judge)."},
    )
    reward_service: RewardServiceConfig = field(default_factory=RewardServiceConfig)


def async_enabled(config: object) -> bool:
    """Whether rollout overlaps training: ``async_training``, or when it is null, a staleness bound above 0."""
    value = getattr(config, "async_training", None)
    if value is None:
        return getattr(getattr(config, "rollout", None), "max_head_offpolicyness", 0) > 0
    return value is True


@dataclass
class PPOConfig(GRPOConfig):
    """PPO with a learned critic."""

    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
