"""Prefix-shared vs unshared layout on one GRPO update (imported by the FSDP and DeepSpeed workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import NormConfig, PPOActorConfig

G = 4  # samples per group
LR = 1e3
VOCAB = 200
# Two groups per rank; completions of different lengths, and two identical completions in group 1.
PROMPT_LENS = (9, 14, 6, 11)
COMPLETION_LENS = ((3, 7, 5, 1), (6, 2, 6, 4), (8, 8, 2, 5), (1, 4, 9, 3))


def grpo_batch(seed: int = 11) -> dict[str, torch.Tensor]:
    """A padded GRPO rollout batch: ``G`` rows per prompt, prompt tokens first, behaviour logprobs random."""
    g = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    prompt_lens: list[int] = []
    for i, (p, comps) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS, strict=True)):
        prompt = torch.randint(3, VOCAB, (p,), generator=g).tolist()
        outs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in comps]
        if i == 1:
            outs[2] = list(outs[0])
        rows += [prompt + o for o in outs]
        prompt_lens += [p] * G
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    pos = torch.arange(width)[None, :]
    am = pos < torch.tensor([len(r) for r in rows])[:, None]
    loss_mask = am & (pos >= torch.tensor(prompt_lens)[:, None])
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": loss_mask.long(),
        "logprobs": torch.where(loss_mask, -torch.rand(len(rows), width, generator=g) * 3, 0.0),
        "versions": torch.where(loss_mask, 0, -1),
        "rewards": torch.rand(len(rows), generator=g),
    }


def shared_vs_unshared(engine_cls: type, model: str, **engine_kwargs: Any) -> dict[str, dict[str, Any]]:
    """Per ``prefix_sharing`` off/on (fp32): rank 0's logprobs and entropy-weighted GRPO loss, the grad
    norm, the tokens the model ran, and each weight's gradient.

    AdamW's first step with eps 1 and no clipping moves every weight by ``lr * g / (1 + |g|)``:
    for the small gradients here (|g| < 1e-2) that is ``lr * g`` to 1%, the same map for both
    layouts, so (weights before - after) / lr compares their gradients through the engine's
    public API; lr = 1e3 keeps the fp32 rounding of the weights far below the gradients.
    """
    r, w = dist.get_rank(), dist.get_world_size()
    n = G * len(PROMPT_LENS) // w
    batch = {k: v[r * n : (r + 1) * n] for k, v in grpo_batch().items()}
    out = {}
    for mode in ("off", "on"):
        cfg = TrainEngineConfig(
            path=model,
            mixed_precision=None,
            prefix_sharing=mode,
            mb_spec=MicroBatchSpec(n_mbs=2),
            optimizer=OptimizerConfig(lr=LR, eps=1.0, gradient_clipping=0.0),
            **engine_kwargs,
        )
        e = engine_cls(cfg)
        e.create_process_group()
        e.initialize(None, None)
        norm = NormConfig(mean_level="group", std_level="group", unit="sequence")
        actor_cfg = PPOActorConfig(
            engine=cfg,
            group_size=G,
            adv_norm=norm,
            use_decoupled_loss=True,
            behav_imp_weight_cap=5.0,
            entropy_coeff=0.01,
        )
        actor = PPOActor(actor_cfg, e)
        tokens = sum(len(mb.get("shared_input_ids", mb["input_ids"])) for mb in e._split(batch).mbs)
        logp = actor.compute_logp(batch)
        before = e.full_state_dict()
        stats = actor.ppo_update(actor.compute_advantages({**batch, "prox_logp": logp}))[0]
        after = e.full_state_dict()
        grads = {k: (before[k] - after[k]) / LR for k in before}
        out[mode] = {
            "logp": logp,
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "tokens": tokens,
            "grads": grads,
        }
        e.destroy()
    return out
