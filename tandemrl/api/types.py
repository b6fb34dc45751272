"""Small value types shared by all training engines and their callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, TypedDict

import torch

from tandemrl.api.parallel import ParallelStrategy as ParallelStrategy  # re-exported: its home before api/parallel.py

# A batch: named tensors. Padded batches are [B, L] with an `attention_mask`;
# packed micro-batches are 1-D over tokens with `cu_seqlens` (see tandemrl/engines/packing.py).
TensorDict = dict[str, torch.Tensor]

# MoE routing replay: [B, L, n_layers, k] int64, the experts each layer routed token t to at the behaviour
# weights (-1 at dense layers and padding); written and read by engines with router replay on (docs/moe.md).
ROUTED_EXPERTS: Final = "routed_experts"


class _RolloutOptional(TypedDict, total=False):
    # [B, L] 1 on generated tokens of a call sent with an output constraint (structured outputs);
    # set by the agent workflow, read by tandemrl.algorithms.constrained
    constrained: torch.Tensor
    # [B, L, n_layers, k] MoE routing recorded for replay (ROUTED_EXPERTS above)
    routed_experts: torch.Tensor


class RolloutBatch(_RolloutOptional):
    """A padded [B, L] training batch as the rollout workflows produce it.

    Token fields are token-aligned (``logprobs[:, t] = log p(token t | < t)``). An algorithm
    that adds fields declares them in a TypedDict of its own that extends this one
    (e.g. ``tandemrl.algorithms.ppo.PPOBatch``). ``constrained`` is optional.
    """

    input_ids: torch.Tensor  # [B, L] prompt + response tokens, right-padded
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens
    loss_mask: torch.Tensor  # [B, L] 1 on generated (trainable) tokens
    logprobs: torch.Tensor  # [B, L] behaviour-policy logprob of each generated token, 0 elsewhere
    versions: torch.Tensor  # [B, L] weight version that generated each token, -1 on prompt/padding
    rewards: torch.Tensor  # [B] per-sequence reward (some workflows: [B, L] per token)


@dataclass
class FinetuneSpec:
    """How long training runs; engines size LR schedules from it."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    total_train_steps_override: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        if self.total_train_steps_override is not None:
            return self.total_train_steps_override
        return self.total_train_epochs * self.steps_per_epoch


@dataclass
class SaveLoadMeta:
    """What to save or load and where.

    weight_format "hf" is a safetensors directory that transformers and inference
    servers reload (with LoRA: the merged weights); "dcp" is a torch.distributed.checkpoint
    of model + optimizer + scheduler for exact resumption; "peft" (LoRA engines, save only)
    is the adapter alone as a PEFT directory (docs/lora.md).
    """

    path: str
    weight_format: str = "hf"
    with_optim: bool = False
    tokenizer_path: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
