"""torchrun worker of the cross-backend parity test: the same SFT, PPO and critic steps on each backend row.

Every row (see ``CASES`` in tests/integration/test_backend_parity.py) names an allocation_mode and
dotted TrainEngineConfig overrides; the engine class comes from the actor registry, so
this worker knows nothing backend-specific. Rank 0 writes ``<row>.pt`` with the losses and
grad norms of 5 SFT steps then 3 PPO steps of one engine, and the values, value losses and
grad norms of 3 critic PPO steps (on the same rollouts) of a critic engine built from one
shared critic checkpoint (``critic-init/``, saved by the first launch; ``critic-init-llama/`` for rows
with ``"model": "llama"``, which train ``--llama`` instead of ``--model``).

A row with ``"critic_export": true`` also exports (HF format) its trained critic, with the
values it computes on a probe batch, and a critic built from the causal-LM checkpoint (fresh
value head): the test reloads both with ``AutoModelForTokenClassification``.
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

from tandemrl.algorithms.ppo import PPOActor, PPOCritic
from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig, PPOCriticConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.registry import make_engine
from tandemrl.engines.teardown import destroy_process_groups

SFT_STEPS = 5
PPO_STEPS = 3
# A decaying schedule, so the backends must also agree on the LR of every step.
OPTIM = dict(lr=2e-4, gradient_clipping=1.0, lr_scheduler_type="linear", min_lr_ratio=0.5)
CRITIC_SEED = 1234  # the shared critic checkpoint's value head: HF's init after torch.manual_seed(CRITIC_SEED)
CRITIC_DIR = "critic-init"
# GAE of the critic steps (returns depend on the values), and value clipping.
CRITIC = dict(discount=0.9, gae_lambda=0.95, eps_clip_value=0.5)
PROBE_SEED = 99  # the probe rollout an exported critic is checked on


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
    """Sum over the data-parallel group, reduced on the engine's device (NCCL reduces GPU tensors only)."""
    t = value.detach().double().sum().reshape(1).to(engine.device)
    if engine.data_parallel_world_size > 1:
        dist.all_reduce(t, group=engine.data_parallel_group)
    return float(t)


def build(case: dict[str, Any], cfg: TrainEngineConfig, steps: int) -> Any:
    component = parse_allocation(case["allocation"]).train
    assert component is not None, case
    cfg.mb_spec = MicroBatchSpec(n_mbs=2)
    cfg.optimizer = OptimizerConfig(**OPTIM)
    apply_overrides(cfg, case.get("overrides", {}))
    engine = make_engine(component.backend, cfg)
    engine.create_process_group(component.strategy)
    engine.initialize(None, FinetuneSpec(1, steps, 1))
    return engine


def save_critic_checkpoint(model: str, path: str) -> None:
    """Rank 0 (once for all launches): HF's critic of the tiny model, value head seeded, as an HF directory."""
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

        config = AutoConfig.from_pretrained(model)
        config.num_labels, config.classifier_dropout = 1, 0.0  # as load_model_config sets them for critics
        torch.manual_seed(CRITIC_SEED)
        critic = AutoModelForTokenClassification.from_pretrained(model, config=config, dtype=torch.float32)
        critic.save_pretrained(path)
        AutoTokenizer.from_pretrained(model).save_pretrained(path)
    dist.barrier()


def critic_dir(case: dict[str, Any]) -> str:
    """The shared critic checkpoint of the row's model (one per model)."""
    return CRITIC_DIR + (f"-{case['model']}" if "model" in case else "")


def build_critic(case: dict[str, Any], path: str, model: str) -> Any:
    cfg = TrainEngineConfig(path=path, tokenizer_path=model, is_critic=True, mixed_precision=None)
    return build(case, cfg, PPO_STEPS)


def run_critic(case: dict[str, Any], model: str, out_dir: str) -> dict[str, Any]:
    """3 critic PPO steps (values, GAE returns from them, value-loss update) on the actor's PPO rollouts."""
    e = build_critic(case, os.path.join(out_dir, critic_dir(case)), model)
    critic = PPOCritic(PPOCriticConfig(engine=e.config, group_size=GROUP, eps_clip_value=CRITIC["eps_clip_value"]), e)
    gae_cfg = PPOActorConfig(group_size=GROUP, discount=CRITIC["discount"], gae_lambda=CRITIC["gae_lambda"])
    gae = PPOActor(gae_cfg, e)
    out: dict[str, Any] = {k: [] for k in ("critic_values_sum", "critic_loss", "critic_grad_norm")}
    for step in range(PPO_STEPS):
        batch = dp_slice(e, make_rollout_batch(model, seed=40 + step))
        batch["values"] = critic.compute_values(batch)
        batch = gae.compute_advantages(batch)
        (stats,) = critic.ppo_update(batch)
        out["critic_values_sum"].append(dp_sum(e, batch["values"] * batch["attention_mask"]))
        out["critic_loss"].append(stats["loss"])
        out["critic_grad_norm"].append(stats["grad_norm"])
    if case.get("critic_export"):
        out["critic_export"] = export_trained_critic(e, case, model, out_dir)
    e.destroy()
    if case.get("critic_export"):  # after destroy: one engine at a time
        out["critic_export"].update(export_fresh_critic(case, model, out_dir))
    return out


def export_trained_critic(e: Any, case: dict[str, Any], model: str, out_dir: str) -> dict[str, Any]:
    """HF export of the trained critic ``e`` and its values on a probe batch (the test reloads and compares)."""
    if e.data_parallel_world_size != 1:
        raise ValueError(f"{case['name']}: critic_export needs a row without data parallelism (whole probe batch)")
    path = os.path.join(out_dir, f"{case['name']}-critic-hf")
    e.save(SaveLoadMeta(path=path, weight_format="hf"))
    probe = make_rollout_batch(model, seed=PROBE_SEED)
    values = PPOCritic(PPOCriticConfig(engine=e.config), e).compute_values(probe)
    return {"trained": path, "probe": probe, "probe_values": values.cpu()}


def export_fresh_critic(case: dict[str, Any], model: str, out_dir: str) -> dict[str, Any]:
    """HF export of a critic built from the causal LM ``model``: lm_head ignored, value head as HF initialises it."""
    e = build_critic(case, model, model)
    path = os.path.join(out_dir, f"{case['name']}-critic-from-lm")
    e.save(SaveLoadMeta(path=path, weight_format="hf"))
    seed = e.config.seed
    e.destroy()
    return {"from_lm": path, "seed": seed}


def run_case(case: dict[str, Any], model: str) -> dict[str, list[float]]:
    """One engine per row: 5 SFT steps (through SFTActor), then 3 decoupled-PPO steps on fresh rollouts."""
    cfg = PPOActorConfig(engine=TrainEngineConfig(path=model, mixed_precision=None), group_size=GROUP)
    apply_overrides(cfg, CONFIGS["decoupled"])
    e = build(case, cfg.engine, SFT_STEPS + PPO_STEPS)
    actor = PPOActor(cfg, e)
    out: dict[str, list[float]] = {
        k: [] for k in ("sft_loss", "sft_grad_norm", "ppo_logp_sum", "ppo_loss", "ppo_grad_norm")
    }
    sft = SFTActor(e)
    for step in range(SFT_STEPS):
        stats = sft.train_lm(dp_slice(e, make_batch(500 + step)))
        out["sft_loss"].append(stats["loss"])
        out["sft_grad_norm"].append(stats["grad_norm"])
    for step in range(PPO_STEPS):
        batch = dp_slice(e, make_rollout_batch(model, seed=40 + step))
        batch["prox_logp"] = actor.compute_logp(batch)
        batch = actor.compute_advantages(batch)
        (stats,) = actor.ppo_update(batch)
        out["ppo_logp_sum"].append(dp_sum(e, batch["prox_logp"]))
        out["ppo_loss"].append(stats["loss"])
        out["ppo_grad_norm"].append(stats["grad_norm"])
    e.destroy()
    return out


def main(args: argparse.Namespace) -> None:
    init_default_process_group()
    for case in json.loads(args.cases):
        model = args.llama if case.get("model") == "llama" else args.model
        save_critic_checkpoint(model, os.path.join(args.out, critic_dir(case)))
        result = run_case(case, model)
        result.update(run_critic(case, model, args.out))
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(args.out, f"{case['name']}.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="JSON list of rows: {name, allocation, overrides}")
    p.add_argument("--model", required=True)
    p.add_argument("--llama", required=True, help='model of the rows with "model": "llama"')
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    # Deterministic mode NaN-fills every torch.empty; DeepSpeed's reduce buckets hold 5e8 elements.
    torch.utils.deterministic.fill_uninitialized_memory = False
    main(a)
    destroy_process_groups()
