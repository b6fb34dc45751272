"""The backend-agnostic training-engine contracts.

- :class:`TrainEngine`: what an algorithm (``PPOActor``, ``SFTActor``, ...) is written against: forward,
  train and evaluate a batch, the data-parallel layout, the weight version, and the optional capabilities a
  backend declares (``router_replay``) instead of an algorithm probing for attributes. So every algorithm runs
  unchanged on FSDP2, Megatron-core and DeepSpeed.
- :class:`TrainBackend`: what a training backend implements: a ``TrainEngine`` plus the lifecycle the trainer
  drives (process groups, build, save/load, stats, teardown) and the weight export and batch hand-off that
  rollout and the weight flow read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from tandemrl.api.inference import ParamSpec
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict

# loss_fn(logits [T, V] of a packed micro-batch, the micro-batch) -> scalar loss
LossFn = Callable[[torch.Tensor, TensorDict], torch.Tensor]
# loss_weight_fn(micro-batch) -> weight of its loss (e.g. its number of loss tokens)
LossWeightFn = Callable[[TensorDict], torch.Tensor | float | int]
# post_hook(logits [T, V], micro-batch) -> per-token result [T, ...]
PostHook = Callable[[torch.Tensor, TensorDict], torch.Tensor]


class TrainEngine(ABC):
    """One model trained SPMD across ranks, as an algorithm sees it; every method is called on every rank."""

    @abstractmethod
    def train(self, mode: bool = True) -> TrainEngine:
        """Put the model in training mode (eval() is train(False))."""

    def eval(self) -> TrainEngine:
        return self.train(False)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device of this rank's computation."""

    @property
    @abstractmethod
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Group across which batches are split and statistics reduced."""

    @property
    @abstractmethod
    def data_parallel_world_size(self) -> int: ...

    @abstractmethod
    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One trainer step of one optimizer step on this rank's share of a padded batch, after which the LR
        schedule advances one step; returns the step stats (their ``lr`` is the one the step used)."""

    @abstractmethod
    def train_minibatches(
        self, minibatches: Iterable[tuple[TensorDict, LossFn]], loss_weight_fn: LossWeightFn
    ) -> list[dict[str, float]]:
        """One trainer step of several optimizer steps: one per ``(minibatch, loss_fn)``, in order, all at the
        same learning rate; then the LR schedule advances one step. Returns each optimizer step's stats."""

    @abstractmethod
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> torch.Tensor:
        """Loss over the batch (weighted across micro-batches and DP ranks), no update."""

    @abstractmethod
    def forward(
        self,
        batch: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: PostHook | None = None,
        aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Per-token outputs of the model (``post_hook`` applied) in the padded layout, on the batch's device."""

    @abstractmethod
    def get_version(self) -> int:
        """Version of the weights (the number of trainer steps taken, or the restored one)."""

    @property
    @abstractmethod
    def model_path(self) -> str:
        """The model directory the engine loaded (its config's ``path``)."""

    # ------------------------------------------------------------ optional capabilities
    # A backend that has one overrides its flag; an algorithm reads the flag, never probes attributes.

    @property
    def router_replay(self) -> bool:
        """MoE routing replay (docs/moe.md): ``forward`` records each token's experts into
        ``batch["routed_experts"]`` when absent and replays them when present, and training replays them."""
        return False


class TrainBackend(TrainEngine):
    """What a training backend implements: the algorithm's :class:`TrainEngine`, the lifecycle the trainer drives,
    and the weight export and batch hand-off of rollout and the weight flow."""

    # The allocation_mode dims (of d, t, p, c, e) this backend may set above 1, e.g. "dtc".
    parallel_dims: ClassVar[str]
    # Whether it takes the MoE hybrid body, ``backend:(attn:<dims>|ffn:<dims>)``.
    moe_hybrid: ClassVar[bool] = False
    # What it can do beyond this interface: names of ``tandemrl.api.allocation.TRAINING_FEATURES``.
    features: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        """Initialise torch.distributed (if needed) and this engine's parallel groups."""

    @abstractmethod
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Build the model, load weights, build optimizer and LR schedule."""

    @abstractmethod
    def destroy(self) -> None:
        """Release the model, optimizer and process groups this engine created."""

    @property
    @abstractmethod
    def has_optimizer(self) -> bool:
        """True when the engine trains (it built an optimizer): a recoverable checkpoint holds its state."""

    @abstractmethod
    def save(self, meta: SaveLoadMeta) -> None: ...

    @abstractmethod
    def load(self, meta: SaveLoadMeta) -> None: ...

    @abstractmethod
    def set_version(self, version: int) -> None: ...

    @abstractmethod
    def export_stats(self) -> dict[str, float]:
        """Statistics recorded since the last export, reduced over the DP group."""

    # ------------------------------------------------------ weight export and batch hand-off
    # What rollout (``tandemrl.rollout``) needs to hand batches to every rank and weights to the servers.

    @property
    @abstractmethod
    def data_parallel_rank(self) -> int: ...

    @abstractmethod
    def is_data_parallel_head(self) -> bool:
        """True on the one rank per DP replica that talks to the rollout side."""

    @abstractmethod
    def broadcast_in_model_parallel_group(self, batch: TensorDict | None) -> TensorDict:
        """Collective in the model-parallel (TP/PP) group: the DP head's batch on every rank of its replica."""

    @property
    def lora_rank(self) -> int:
        """Rank of the LoRA adapters the engine trains (0: none); with one, ``save`` takes weight_format "peft"."""
        return 0

    @property
    def lora_serve(self) -> str:
        """What a disk weight update sends with LoRA: "adapter", "merged" or "auto" (adapter unless on CPU)."""
        return "merged"

    @abstractmethod
    def hf_param_specs(self) -> list[ParamSpec]:
        """HF names, full shapes and dtypes of the weights, in ``iter_hf_params`` order."""

    @abstractmethod
    def iter_hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: full (unsharded) HF-named weights, one at a time, on every rank."""
