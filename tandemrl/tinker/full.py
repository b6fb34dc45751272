"""Full-weight training for one client: the ``--full-weight BACKEND`` side of ``tandemrl tinker-serve``.

The model is a tandemrl training engine from the registry (``fsdp``, ``deepspeed`` or ``megatron``,
the last with tensor and pipeline parallel size 1) at world size 1 in the server's own process. A
Tinker ``forward_backward`` runs the engine's ``forward`` for its outputs (per-target logprobs and
the per-token loss) and keeps its datums; the next ``optim_step`` runs one ``train_batch`` over
every datum kept since the last step (forward, backward, one optimizer step) with that call's Adam
parameters. The gradient is the one Tinker accumulates: the weights do not change between a
client's ``forward_backward`` and its ``optim_step``, and the batch loss is the plain sum over tokens
and datums (each micro-batch's loss is rescaled so the engine's token-weighted mean comes out as
that sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandemrl.algorithms.tinker_losses import tinker_loss
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict
from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.registry import engine_class
from tandemrl.models.functional import gather_logprobs
from tandemrl.tinker.trainer import set_adam_params

FULL_WEIGHT_BACKENDS = ("fsdp", "deepspeed", "megatron")
LOSS_INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")


@dataclass
class Pending:
    """The datums of one ``forward_backward`` call waiting for ``optim_step``."""

    data: list[dict[str, torch.Tensor]]
    loss_fn: str
    config: dict[str, float]


@dataclass
class FullClient:
    model_id: str
    steps: int = 0
    pending: list[Pending] = field(default_factory=list)


def check_backend(backend: str) -> None:
    if backend not in FULL_WEIGHT_BACKENDS:
        raise ValueError(f"--full-weight: unknown backend {backend!r} (one of: {', '.join(FULL_WEIGHT_BACKENDS)})")


def _padded(data: list[dict[str, torch.Tensor]], calls: list[int]) -> TensorDict:
    """The engine's padded batch: ``input_ids``, ``attention_mask``, every loss input per token, the call index."""
    lens = [int(d["input_ids"].numel()) for d in data]
    width = max(lens)
    keys = sorted({k for d in data for k in d if k != "input_ids"})
    batch = {"input_ids": torch.zeros(len(data), width, dtype=torch.long)}
    batch["attention_mask"] = torch.zeros(len(data), width, dtype=torch.bool)
    for k in keys:
        batch[k] = torch.zeros(len(data), width, dtype=torch.long if k == "target_tokens" else torch.float32)
    for i, (d, n) in enumerate(zip(data, lens, strict=True)):
        batch["input_ids"][i, :n] = d["input_ids"]
        batch["attention_mask"][i, :n] = True
        for k in keys:
            if k in d:
                batch[k][i, :n] = d[k]
    batch["tinker_call"] = torch.tensor(calls, dtype=torch.long)
    return batch


class FullWeightTrainer:
    """One full-weight training client at a time on a registry engine (see the module docstring)."""

    max_rank = 0  # no adapters here

    def __init__(self, model_dir: str, backend: str) -> None:
        check_backend(backend)
        self.model_dir, self.backend = model_dir, backend
        init_default_process_group()  # a world of one in this process
        config = TrainEngineConfig(
            path=model_dir, mixed_precision=None, optimizer=OptimizerConfig(lr=1e-4, gradient_clipping=0.0)
        )
        self.engine = engine_class(backend)(config)
        self.engine.create_process_group(ParallelStrategy(dp=1))
        self.client: FullClient | None = None

    # ------------------------------------------------------------------ the one client
    def add(self, model_id: str, rank: int, targets: tuple[str, ...], seed: int | None) -> None:
        """A fresh model from the base weights and a fresh optimizer (rank and targets do not apply)."""
        if self.client is not None:
            raise ValueError(f"create_model: full-weight client {self.client.model_id!r} is live; unload it first")
        self.engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
        self.client = FullClient(model_id)

    def remove(self, model_id: str) -> None:
        if self.client is not None and self.client.model_id == model_id:
            self.engine.destroy()
            self.client = None

    def _client(self, model_id: str) -> FullClient:
        if self.client is None or self.client.model_id != model_id:
            raise ValueError(f"model_id: {model_id!r} is not the live full-weight client")
        return self.client

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, model_id: str, data: list[dict[str, torch.Tensor]], loss_fn: str, config: dict[str, float], backward: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per-datum ``logprobs`` and ``elementwise_loss`` at the current weights; with ``backward`` the datums
        wait for ``optim_step``, which computes their gradient at these same weights."""
        client = self._client(model_id)
        batch = _padded(data, [0] * len(data))

        def hook(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            return gather_logprobs(logits, mb["target_tokens"])

        logp = self.engine.forward(batch, post_hook=hook).float().cpu()
        outputs, total = [], 0.0
        for i, d in enumerate(data):
            n = int(d["input_ids"].numel())
            inputs = {k: v for k, v in d.items() if k not in ("input_ids", "target_tokens")}
            per_token = tinker_loss(loss_fn, logp[i, :n], inputs, config)
            total += float(per_token.sum())
            outputs.append({"logprobs": logp[i, :n].clone(), "elementwise_loss": per_token.detach()})
        if backward:
            client.pending.append(Pending(data, loss_fn, dict(config)))
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One engine ``train_batch`` over the kept datums with this call's Adam parameters."""
        client = self._client(model_id)
        if not client.pending:
            raise ValueError("optim_step: no forward_backward since the last step (nothing to apply)")
        calls = [i for i, p in enumerate(client.pending) for _ in p.data]
        batch = _padded([d for p in client.pending for d in p.data], calls)
        pending, total_tokens = client.pending, float(batch["attention_mask"].sum())
        self._set_adam(adam)

        def loss_fn(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
            logp = gather_logprobs(logits, mb["target_tokens"])
            cu, loss = mb["cu_seqlens"].tolist(), logits.new_zeros((), dtype=torch.float32)
            for row, call in enumerate(mb["tinker_call"].tolist()):
                s, e = cu[row], cu[row + 1]
                inputs = {k: mb[k][s:e] for k in LOSS_INPUTS if k in mb}
                loss = loss + tinker_loss(pending[call].loss_fn, logp[s:e], inputs, pending[call].config).sum()
            return loss * (total_tokens / logp.numel())  # the engine weights it by tokens / total_tokens

        stats = self.engine.train_batch(batch, loss_fn, lambda mb: float(mb["input_ids"].numel()))
        client.pending = []
        client.steps += 1
        return {"grad_norm": float(stats["grad_norm"]), "step": float(client.steps)}

    def _set_adam(self, adam: dict[str, Any]) -> None:
        opt_cfg = self.engine.config.optimizer
        assert opt_cfg is not None
        opt_cfg.gradient_clipping = float(adam.get("grad_clip_norm", 0.0))
        groups = self.engine.built_optimizer.param_groups
        set_adam_params(groups, adam)
        schedule = self.engine.lr_scheduler
        if schedule is not None:  # megatron copies its schedule's LR into its groups before each step
            for group in schedule.optimizer.param_groups:
                group["lr"] = groups[0]["lr"]

    # ------------------------------------------------------------------ checkpoints
    def save_for_sampler(self, model_id: str, path: str) -> None:
        """The full model as an HF safetensors directory, what a vLLM disk update loads."""
        self._client(model_id)
        self.engine.save(SaveLoadMeta(path, weight_format="hf", tokenizer_path=self.model_dir))

    def save_state(self, model_id: str, path: str) -> None:
        """Model, optimizer and schedule (the engine's recoverable ``dcp`` checkpoint)."""
        self._client(model_id)
        self.engine.save(SaveLoadMeta(path, weight_format="dcp", with_optim=True))

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        self._client(model_id)
        self.engine.load(SaveLoadMeta(path, weight_format="dcp", with_optim=optimizer))
