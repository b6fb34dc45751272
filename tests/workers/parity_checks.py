"""torchrun worker of the cross-backend parity test: the same SFT and PPO steps on each given backend row.

Every row (see ``CASES`` in tests/test_backend_parity.py) names an allocation_mode and
dotted TrainEngineConfig overrides; the engine class comes from the actor registry, so
this worker knows nothing backend-specific. Rank 0 writes ``<row>.pt`` with the losses and
grad norms of 5 SFT steps then 3 PPO steps of one engine.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from fsdp_checks import make_batch
from ppo_checks import CONFIGS, GROUP, make_rollout_batch

from tandemrl.actors.lm import LMEngine
from tandemrl.actors.registry import engine_class
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.types import FinetuneSpec
from tandemrl.utils.allocation import AllocationMode

SFT_STEPS = 5
PPO_STEPS = 3
# A decaying schedule, so the backends must also agree on the LR of every step.
OPTIM = dict(lr=2e-4, gradient_clipping=1.0, lr_scheduler_type="linear", min_lr_ratio=0.5)


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> None:
    """``{"deepspeed.zero_stage": 3}`` -> ``cfg.deepspeed.zero_stage = 3``; unknown keys fail loudly."""
    for dotted, value in overrides.items():
        *path, leaf = dotted.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, leaf):
            raise AttributeError(f"override '{dotted}': {type(obj).__name__} has no field '{leaf}'")
        setattr(obj, leaf, value)


def dp_slice(engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This data-parallel rank's contiguous share of a global batch (model-parallel peers get the same)."""
    r, w = engine.data_parallel_rank, engine.data_parallel_world_size
    n = batch["input_ids"].shape[0] // w
    return {k: v[r * n : (r + 1) * n].clone() for k, v in batch.items()}


def dp_sum(engine: Any, value: torch.Tensor) -> float:
    t = value.detach().double().sum().reshape(1).cpu()
    if engine.data_parallel_world_size > 1:
        dist.all_reduce(t, group=engine.data_parallel_group)
    return float(t)


def build(algorithm: str, case: dict[str, Any], cfg: PPOActorConfig, steps: int) -> Any:
    component = AllocationMode.from_str(case["allocation"]).train
    assert component is not None, case
    cfg.mb_spec = MicroBatchSpec(n_mbs=2)
    cfg.optimizer = OptimizerConfig(**OPTIM)
    apply_overrides(cfg, case.get("overrides", {}))
    engine = engine_class(algorithm, component.backend)(cfg)
    engine.create_process_group(component.strategy)
    engine.initialize(None, FinetuneSpec(1, steps, 1))
    return engine


def run_case(case: dict[str, Any], model: str) -> dict[str, list[float]]:
    """One engine per row: 5 SFT steps (through LMEngine), then 3 decoupled-PPO steps on fresh rollouts."""
    cfg = PPOActorConfig(path=model, group_size=GROUP)
    apply_overrides(cfg, CONFIGS["decoupled"])
    e = build("ppo_actor", case, cfg, SFT_STEPS + PPO_STEPS)
    out: dict[str, list[float]] = {
        k: [] for k in ("sft_loss", "sft_grad_norm", "ppo_logp_sum", "ppo_loss", "ppo_grad_norm")
    }
    sft = LMEngine(e)
    for step in range(SFT_STEPS):
        stats = sft.train_lm(dp_slice(e, make_batch(500 + step)))
        e.step_lr_scheduler()
        out["sft_loss"].append(stats["loss"])
        out["sft_grad_norm"].append(stats["grad_norm"])
    for step in range(PPO_STEPS):
        batch = dp_slice(e, make_rollout_batch(model, seed=40 + step))
        batch["prox_logp"] = e.compute_logp(batch)
        e.compute_advantages(batch)
        (stats,) = e.ppo_update(batch)
        e.step_lr_scheduler()
        out["ppo_logp_sum"].append(dp_sum(e, batch["prox_logp"]))
        out["ppo_loss"].append(stats["loss"])
        out["ppo_grad_norm"].append(stats["grad_norm"])
    e.destroy()
    return out


def main(args: argparse.Namespace) -> None:
    init_default_process_group()
    for case in json.loads(args.cases):
        result = run_case(case, args.model)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(args.out, f"{case['name']}.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="JSON list of rows: {name, allocation, overrides}")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    # Deterministic mode NaN-fills every torch.empty; DeepSpeed's reduce buckets hold 5e8 elements.
    torch.utils.deterministic.fill_uninitialized_memory = False
    main(a)
    dist.destroy_process_group()
