"""torchrun worker (2 ranks): a new algorithm written as ONE class trains on every backend.

``GroupMeanReinforce`` below is REINFORCE with a group-mean baseline and an entropy bonus, built
only from ``tandemrl.algorithms`` functions and the ``TrainEngine`` contract. The same class takes
2 steps on FSDP2 (d2), DeepSpeed ZeRO-3 (d2) and Megatron (t2), one engine after the other (Megatron
last: its CPU shims patch process-wide state); each engine comes from the registry row of its
backend. The same engine then takes 2 PPO steps of 2 minibatches each (``PPOActor.ppo_update``); no
one steps the LR schedule (warmup then cosine over the 4 steps): the engine does. Rank 0 writes
``new_algorithm.pt``: per backend, the step losses, the largest weight change and the lr of every
optimizer step.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from ppo_checks import GROUP, make_rollout_batch

from tandemrl.algorithms import entropy_bonus, group_normalized_advantages, reinforce_loss
from tandemrl.algorithms.ppo import PPOActor, PPOBatch, action_mask_of
from tandemrl.api.engine import TrainEngine
from tandemrl.api.types import FinetuneSpec, RolloutBatch, TensorDict
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import DeepSpeedEngineConfig, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.registry import make_engine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.functional import gather_logprobs_entropy, next_token_labels

STEPS = 2
PPO_STEPS, PPO_MINIBATCHES = 2, 2
# Linear warmup over half the run, then cosine decay to 0.2 * lr (tests/integration/test_new_algorithm.py computes it by hand).
SCHEDULE = {"lr": 1e-3, "lr_scheduler_type": "cosine", "warmup_steps_proportion": 0.5, "min_lr_ratio": 0.2}
BACKENDS = {
    "fsdp": ("fsdp:d2", {}),
    "deepspeed-zero3": ("deepspeed:d2", {"deepspeed": DeepSpeedEngineConfig(zero_stage=3)}),
    "megatron-t2": ("megatron:t2", {}),
}


# ----------------------------------------------------------------------------- the new algorithm
@dataclass
class GroupMeanReinforceConfig:
    group_size: int = GROUP  # consecutive rows sampled from one prompt
    entropy_coeff: float = 0.01


class GroupMeanReinforce:
    """``-(r - mean_group(r)) * log p(token) - entropy_coeff * H``, averaged over generated tokens."""

    def __init__(self, config: GroupMeanReinforceConfig, engine: TrainEngine):
        self.config, self.engine = config, engine

    def _loss(self, logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        labels = next_token_labels(mb["input_ids"], mb["cu_seqlens"])
        logp, entropy = gather_logprobs_entropy(logits, labels)
        mask = mb["action_mask"].bool()
        return reinforce_loss(logp, mb["advantages"], mask) + entropy_bonus(entropy, mask, self.config.entropy_coeff)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        action = action_mask_of(batch)
        baseline_adv = group_normalized_advantages(batch["rewards"].float(), self.config.group_size, use_std=False)
        data = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "action_mask": action,
            "advantages": torch.where(action, baseline_adv[:, None], 0.0),
        }
        self.engine.train()
        stats = self.engine.train_batch(data, self._loss, lambda mb: int(mb["action_mask"].sum()))
        return stats


# ----------------------------------------------------------------------------- the same class on each backend
def weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Full HF-named weights on this rank (the weight-export hook every backend implements)."""
    return {name: t.detach().float().cpu().clone() for name, t in engine.iter_hf_params()}


def dp_share(engine: TrainEngine, batch: RolloutBatch) -> RolloutBatch:
    r, w = engine.data_parallel_rank, engine.data_parallel_world_size
    n = batch["input_ids"].shape[0] // w
    return {k: v[r * n : (r + 1) * n] for k, v in batch.items()}  # type: ignore[return-value]


def build_engine(
    model: str, allocation: str, extra: dict, steps: int = STEPS, schedule: dict | None = None
) -> TrainEngine:
    """The registry's engine for ``allocation``'s training component (fp32; lr 1e-3, or ``schedule`` over
    ``steps``), initialized."""
    component = parse_allocation(allocation).train
    assert component is not None, allocation
    opt = OptimizerConfig(gradient_clipping=1.0, **(schedule or {"lr": 1e-3}))
    cfg = TrainEngineConfig(path=model, mixed_precision=None, optimizer=opt, **extra)
    engine = make_engine(component.backend, cfg)
    engine.create_process_group(component.strategy)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=steps, train_batch_size=1))
    return engine


def run_backend(model: str, allocation: str, extra: dict, batch: RolloutBatch) -> dict:
    engine = build_engine(model, allocation, extra, STEPS + PPO_STEPS, SCHEDULE)
    algo = GroupMeanReinforce(GroupMeanReinforceConfig(), engine)
    before = weights(engine)
    first = [algo.train_step(dp_share(engine, batch)) for _ in range(STEPS)]
    after = weights(engine)
    change = max((after[k] - v).abs().max().item() for k, v in before.items())
    ppo = ppo_steps(engine, model, dp_share(engine, batch))
    engine.destroy()
    lrs = [[s["lr"] for s in step] for step in [[s] for s in first] + ppo]
    losses = [s["loss"] for s in first]
    return {
        "engine": type(engine).__name__,
        "losses": losses,
        "max_weight_change": change,
        "n_weights": len(before),
        "lrs": lrs,  # per trainer step, the lr of each of its optimizer steps
    }


def ppo_steps(engine: TrainEngine, model: str, share: RolloutBatch) -> list[list[dict[str, float]]]:
    """PPO_STEPS ``ppo_update`` calls of PPO_MINIBATCHES minibatches each; the stats of every optimizer step."""
    config = PPOActorConfig(
        engine=TrainEngineConfig(path=model, mixed_precision=None), group_size=GROUP, ppo_n_minibatches=PPO_MINIBATCHES
    )
    actor = PPOActor(config, engine)
    out = []
    for _ in range(PPO_STEPS):
        step: PPOBatch = {**share}  # type: ignore[typeddict-item]
        step["prox_logp"] = actor.compute_logp(step)
        out.append(actor.ppo_update(actor.compute_advantages(step)))
    return out


def on_every_backend(run: Callable[[str, dict], dict], out_file: str) -> None:
    """``run(allocation, engine extra)`` for each of BACKENDS in order; rank 0 saves ``{name: result}`` to ``out_file``."""
    results = {name: run(alloc, extra) for name, (alloc, extra) in BACKENDS.items()}
    if dist.get_rank() == 0:
        torch.save(results, out_file)


def main(args: argparse.Namespace) -> None:
    init_default_process_group()
    batch = make_rollout_batch(args.model)  # 8 rows, groups of 2, rewards with in-group differences
    on_every_backend(
        lambda alloc, extra: run_backend(args.model, alloc, extra, batch), os.path.join(args.out, "new_algorithm.pt")
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    main(p.parse_args())
    destroy_process_groups()
