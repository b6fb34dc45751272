"""The training side of ``tandemrl tinker-serve``: every Tinker training call on one tandemrl ``TrainEngine``.

LoRA (the default): one FSDP2 engine holds the base model, built once with adapters of the
largest rank served on every attention and MLP linear; each training client is a named adapter of
``tandemrl.engines.adapter_bank`` with its own tensors and AdamW state. ``--full-weight BACKEND``:
one client at a time trains every weight on a fresh ``fsdp``, ``deepspeed`` or ``megatron`` engine.

A Tinker ``forward_backward`` is one forward and backward on the engine
(``accumulate_gradients``): its outputs (per-target logprobs, the per-token loss) come from that
forward and its gradient adds to the client's; ``optim_step`` is one AdamW step on the sum
(``apply_gradients``) with that call's Adam parameters. A ``forward`` (no backward) runs the
engine's ``forward``. The loss is the plain sum over tokens and datums: each micro-batch's summed
loss is rescaled so that the engine's token weighting (``weight / the call's total weight``,
averaged over data-parallel ranks) comes out as that sum.

Under torchrun every rank makes each call with the same arguments (``tandemrl.tinker.ranks``): the
datums are split over the data-parallel ranks, each trains on its share, and rank 0 gathers the
outputs. A rank with no datum runs one zero-weight filler row to keep the collectives aligned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.algorithms.tinker_losses import tinker_loss
from tandemrl.api.types import FinetuneSpec, ParallelStrategy, SaveLoadMeta, TensorDict
from tandemrl.configs.engine import LoRAConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.adapter_bank import AdapterBank
from tandemrl.engines.base import BaseTrainEngine, init_default_process_group
from tandemrl.engines.lora import read_adapter, write_adapter
from tandemrl.engines.registry import engine_class
from tandemrl.models.functional import gather_logprobs

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# alpha 32 at every rank, as Tinker's service (its cookbook's LoRA learning-rate helper assumes lora_alpha=32):
# the adapter scale is 32 / rank, so a learning rate tuned on Tinker means the same here.
ALPHA = 32.0
FULL_WEIGHT_BACKENDS = ("fsdp", "deepspeed", "megatron")
LOSS_INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")
FILLER = -1  # the ``tinker_call`` of a rank's filler row
MAX_TOKENS_PER_MB = 1024


def targets_of(train_attn: bool, train_mlp: bool) -> tuple[str, ...]:
    targets = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    if not targets:
        raise ValueError("lora_config: train_attn and train_mlp are both false; nothing to adapt")
    return targets


def check_backend(backend: str) -> None:
    if backend not in FULL_WEIGHT_BACKENDS:
        raise ValueError(f"--full-weight: unknown backend {backend!r} (one of: {', '.join(FULL_WEIGHT_BACKENDS)})")


@dataclass
class Client:
    rank: int  # LoRA rank; 0 for the full-weight client
    steps: int = 0
    pending: int = 0  # forward_backward calls whose gradient waits for optim_step


def padded_batch(data: list[dict[str, torch.Tensor]], calls: list[int]) -> TensorDict:
    """The engine's padded batch: ``input_ids``, ``attention_mask``, every loss input per token, and per row
    ``tinker_call``: the datum's index in its call (``FILLER`` for a filler row)."""
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


def _real_tokens(mb: TensorDict) -> float:
    """Tokens of a packed micro-batch's datums (not of filler rows)."""
    lens = mb["cu_seqlens"].diff()
    return float(lens[mb["tinker_call"].to(lens.device) != FILLER].sum())


class EngineTrainer:
    """Tinker training calls on a ``TrainEngine`` (see the module docstring); ``full_weight`` names the backend of
    full-weight training, empty for LoRA clients of rank up to ``max_rank`` on FSDP2."""

    def __init__(self, model_dir: str, max_rank: int = 8, full_weight: str = "", compute_dtype: str | None = None):
        if full_weight:
            check_backend(full_weight)
        self.model_dir, self.full_weight = model_dir, full_weight
        self.max_rank = 0 if full_weight else max_rank
        init_default_process_group()  # the torchrun world, or a world of one in this process
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        # calls, gathers: a CPU group whatever the engine's backend (NCCL moves no Python objects)
        self.object_group = dist.new_group(backend="gloo") if self.world > 1 else None
        lora = LoRAConfig() if full_weight else LoRAConfig(rank=max_rank, alpha=ALPHA, target_modules=list(ATTN + MLP))
        config = TrainEngineConfig(
            path=model_dir,
            mixed_precision=compute_dtype,
            # a group's answers share their prompt: computed once, with exact per-row logits (docs/prefix_sharing.md)
            prefix_sharing="auto",
            # ~1k tokens per micro-batch: one batch-sized pass of 32 x 140 tokens was 2.5x slower here
            # (its [tokens, vocab] logits leave the caches; docs/tinker.md "Training on the engines")
            mb_spec=MicroBatchSpec(max_tokens_per_mb=MAX_TOKENS_PER_MB),
            optimizer=OptimizerConfig(lr=1e-4, gradient_clipping=0.0, weight_decay=0.0),
            lora=lora,
        )
        self.engine: BaseTrainEngine = engine_class(full_weight or "fsdp")(config)
        self.engine.create_process_group(ParallelStrategy(dp=self.world))
        self.clients: dict[str, Client] = {}
        self.bank: AdapterBank | None = None
        if not full_weight:  # the base model once, for every adapter
            self.engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
            self.bank = AdapterBank(self.engine.built_model, self.engine.built_optimizer)

    # ------------------------------------------------------------------ clients
    def add(self, model_id: str, rank: int, targets: tuple[str, ...], seed: int | None) -> None:
        """A new client: an adapter (from ``seed``), or for full weights a fresh model from the base weights."""
        if self.bank is not None:
            if not 1 <= rank <= self.max_rank:
                raise ValueError(f"lora_config.rank: {rank} is outside 1..{self.max_rank} (--max-lora-rank)")
            self.bank.add(model_id, rank, ALPHA, targets, seed if seed is not None else len(self.clients))
        else:
            if self.clients:
                live = next(iter(self.clients))
                raise ValueError(f"create_model: full-weight client {live!r} is live; unload it first")
            self.engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
        self.clients[model_id] = Client(rank)

    def remove(self, model_id: str) -> None:
        if self.clients.pop(model_id, None) is None:
            return
        if self.bank is not None:
            self.bank.remove(model_id)
        else:
            self.engine.destroy()

    def _client(self, model_id: str) -> Client:
        if model_id not in self.clients:
            raise ValueError(f"model_id: {model_id!r} is not a live training client")
        if self.bank is not None:
            self.bank.activate(model_id)
        return self.clients[model_id]

    def _share(self, data: list[dict[str, torch.Tensor]], calls: list[int]) -> tuple[list[int], TensorDict]:
        """This rank's datums (indices into ``data``) and their padded batch; a filler row when it has none."""
        mine = list(range(self.rank, len(data), self.world))
        if not mine:
            filler = {"input_ids": torch.zeros(2, dtype=torch.long), "target_tokens": torch.zeros(2, dtype=torch.long)}
            return [], padded_batch([filler], [FILLER])
        return mine, padded_batch([data[i] for i in mine], [calls[i] for i in mine])

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, model_id: str, data: list[dict[str, torch.Tensor]], loss_fn: str, config: dict[str, float], backward: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per-datum ``logprobs`` and ``elementwise_loss`` at the current weights and the summed loss (rank 0's);
        with ``backward`` the same forward's gradient adds to the client's, for its next ``optim_step``."""
        client = self._client(model_id)
        mine, batch = self._share(data, list(range(len(data))))
        logps: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}  # per-token losses the backward's forward computed already
        if backward:
            total = float(sum(int(d["input_ids"].numel()) for d in data))  # the batch's weight on every rank

            def loss_of(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
                logp = gather_logprobs(logits, mb["target_tokens"])
                cu, loss = mb["cu_seqlens"].tolist(), logits.new_zeros((), dtype=torch.float32)
                for row, i in enumerate(mb["tinker_call"].tolist()):
                    s, e = cu[row], cu[row + 1]
                    if i == FILLER:
                        loss = loss + 0.0 * logp[s:e].sum()
                        continue
                    inputs = {k: mb[k][s:e] for k in LOSS_INPUTS if k in mb}
                    per_token = tinker_loss(loss_fn, logp[s:e], inputs, config)
                    logps[i], losses[i] = logp[s:e].detach().float().cpu(), per_token.detach().float().cpu()
                    loss = loss + per_token.sum()
                weight = _real_tokens(mb)
                return loss * (total / weight) if weight > 0 else loss  # the engine weights it by weight / total

            self.engine.accumulate_gradients(batch, loss_of, _real_tokens, total)
            client.pending += 1
        else:

            def hook(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
                return gather_logprobs(logits, mb["target_tokens"])

            padded = self.engine.forward(batch, post_hook=hook).float().cpu()
            logps = {i: padded[row, : int(data[i]["input_ids"].numel())] for row, i in enumerate(mine)}
        outputs: list[tuple[int, dict[str, torch.Tensor]]] = []
        for i in mine:
            if i not in losses:
                inputs = {k: v for k, v in data[i].items() if k not in ("input_ids", "target_tokens")}
                losses[i] = tinker_loss(loss_fn, logps[i], inputs, config).detach()
            outputs.append((i, {"logprobs": logps[i].clone(), "elementwise_loss": losses[i]}))
        ordered = [out for _, out in sorted(self._gather(outputs), key=lambda pair: pair[0])]
        return ordered, {"loss:sum": float(sum(float(o["elementwise_loss"].sum()) for o in ordered))}

    def _gather(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items`` concatenated on rank 0 (an empty list elsewhere)."""
        if self.world == 1:
            return items
        parts: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(items, parts if self.rank == 0 else None, dst=0, group=self.object_group)
        return [x for part in parts for x in part]

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step with this call's parameters on the gradient of the ``forward_backward`` calls since the
        last step."""
        client = self._client(model_id)
        if not client.pending:
            raise ValueError("optim_step: no forward_backward since the last step (nothing to apply)")
        self._set_adam(adam)
        stats = self.engine.apply_gradients()
        client.pending = 0
        client.steps += 1
        return {"grad_norm": float(stats["grad_norm"]), "step": float(client.steps)}

    def _set_adam(self, adam: dict[str, Any]) -> None:
        """One ``optim_step``'s Adam parameters (Tinker sends them with every step), with the SDK's defaults."""
        self.engine.set_optimizer_params(
            lr=float(adam.get("learning_rate", 1e-4)),
            betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
            eps=float(adam.get("eps", 1e-12)),
            weight_decay=float(adam.get("weight_decay", 0.0)),
            gradient_clipping=float(adam.get("grad_clip_norm", 0.0)),
        )

    # ------------------------------------------------------------------ checkpoints
    def save_for_sampler(self, model_id: str, path: str) -> None:
        """LoRA: the PEFT adapter directory vLLM loads. Full weights: the model as an HF safetensors directory."""
        client = self._client(model_id)
        if self.bank is None:
            self.engine.save(SaveLoadMeta(path, weight_format="hf", tokenizer_path=self.model_dir))
            return
        tensors = self.bank.peft_tensors(model_id)
        if self.rank == 0:
            write_adapter(path, tensors, LoRAConfig(rank=client.rank, alpha=ALPHA), self.model_dir)

    def save_state(self, model_id: str, path: str) -> None:
        """LoRA: the adapter plus its AdamW state and step count. Full weights: the engine's ``dcp`` checkpoint."""
        client = self._client(model_id)
        if self.bank is None:
            self.engine.save(SaveLoadMeta(path, weight_format="dcp", with_optim=True))
            return
        self.save_for_sampler(model_id, path)
        state = self.bank.optimizer_state(model_id)
        if self.rank == 0:
            torch.save({"optimizer": state, "steps": client.steps}, os.path.join(path, "optimizer.pt"))

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        client = self._client(model_id)
        if self.bank is None:
            self.engine.load(SaveLoadMeta(path, weight_format="dcp", with_optim=optimizer))
            return
        config, tensors = read_adapter(path)
        if int(config["r"]) != client.rank:
            raise ValueError(f"load_weights: checkpoint rank {config['r']} != this model's rank {client.rank}")
        self.bank.load_tensors(model_id, tensors)
        opt_file = os.path.join(path, "optimizer.pt")
        if optimizer and os.path.isfile(opt_file):
            saved = torch.load(opt_file, weights_only=False)
            self.bank.load_optimizer_state(model_id, saved["optimizer"])
            client.steps = int(saved["steps"])
