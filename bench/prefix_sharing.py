"""GRPO train step with and without the group-shared prompt prefix (``prefix_sharing`` on vs off).

Batches look like the main job's (examples/gsm8k_grpo.yaml): GSM8K prompts rendered by the
model's chat template, ``--samples`` completions of ``--new-tokens`` tokens each (random
tokens: step time does not depend on their values). Two FSDP engines with the same weights,
one per setting, run the same GRPO step interleaved (the first setting alternates): the
recompute forward (``compute_logp``), advantages and one ``ppo_update``. Prints s/step of each,
the speed-up, tokens each layout runs, the largest loss gap and the load average.
Figures are printed, never asserted.

    OMP_NUM_THREADS=2 python bench/prefix_sharing.py --model 25m
    OMP_NUM_THREADS=2 python bench/prefix_sharing.py --model tiny --mixed-precision none
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import DEFAULT_DATA, cache_dir, sync  # noqa: E402
from vs_trl import MODELS  # noqa: E402

from tandemrl.algorithms.ppo import PPOActor  # noqa: E402
from tandemrl.api.types import FinetuneSpec, TensorDict  # noqa: E402
from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig  # noqa: E402
from tandemrl.configs.ppo import NormConfig, PPOActorConfig  # noqa: E402
from tandemrl.engines.fsdp import FSDPEngine  # noqa: E402
from tandemrl.engines.prefix_sharing import sharing_segments  # noqa: E402
from tandemrl.engines.teardown import destroy_process_groups  # noqa: E402
from tandemrl.utils.cli import ArgumentParser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K dir with train.jsonl.")
    ap.add_argument("--model", choices=sorted(MODELS), default="25m", help="tiny Qwen2 (0.56M) or ~25M Qwen2")
    ap.add_argument("--prompts", type=int, default=8, help="Prompts (groups) per step.")
    ap.add_argument("--samples", type=int, default=4, help="Completions per prompt.")
    ap.add_argument("--new-tokens", type=int, default=64, help="Tokens per completion.")
    ap.add_argument("--max-tokens-per-mb", type=int, default=4096, help="Token budget per micro-batch (main job's).")
    ap.add_argument("--mixed-precision", choices=["bfloat16", "none"], default="bfloat16")
    ap.add_argument("--warmup", type=int, default=1, help="Untimed steps per setting.")
    ap.add_argument("--steps", type=int, default=4, help="Timed steps per setting.")
    a = ap.parse_args(argv)
    for name in ("prompts", "samples", "new_tokens", "steps"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be positive")
    if not (Path(a.data) / "train.jsonl").is_file():
        ap.error(f"--data: {Path(a.data) / 'train.jsonl'} not found")
    return a


def grpo_batches(a: argparse.Namespace, model: str) -> list[TensorDict]:
    """Padded rollout batches: each prompt repeated ``--samples`` times, then random completions."""
    from transformers import AutoTokenizer

    from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
    from tandemrl.data.loader import pad_sequences_to_tensors
    from tandemrl.workflows.rlvr import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(model)
    n_steps = a.warmup + a.steps
    ds = get_gsm8k_rl_dataset(a.data, "train", tok, 0, 1, max_length=256, max_samples=n_steps * a.prompts)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for s in range(n_steps):
        rows = []
        for i in range(s * a.prompts, (s + 1) * a.prompts):
            prompt = chat_prompt_ids(tok, ds[i]["messages"])
            for _ in range(a.samples):
                out = torch.randint(0, len(tok), (a.new_tokens,), generator=gen).tolist()
                rows.append({"input_ids": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out)})
        b = pad_sequences_to_tensors(rows, tok.pad_token_id or 0)
        b["logprobs"] = torch.where(b["loss_mask"].bool(), -2.0, 0.0)
        b["versions"] = torch.where(b["loss_mask"].bool(), 0, -1)
        b["rewards"] = torch.randint(0, 2, (len(rows),), generator=gen).float()
        batches.append(b)
    return batches


def build_actor(a: argparse.Namespace, model: str, sharing: str) -> PPOActor:
    cfg = TrainEngineConfig(
        path=model,
        mixed_precision=None if a.mixed_precision == "none" else a.mixed_precision,
        prefix_sharing=sharing,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=a.max_tokens_per_mb),
        optimizer=OptimizerConfig(lr=1e-4),
    )
    engine = FSDPEngine(cfg)
    engine.create_process_group()
    n = a.warmup + a.steps
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=n * a.prompts, train_batch_size=a.prompts))
    norm = NormConfig(mean_level="group", std_level="group", unit="sequence")
    config = PPOActorConfig(
        engine=cfg, group_size=a.samples, adv_norm=norm, use_decoupled_loss=True, behav_imp_weight_cap=5.0
    )
    return PPOActor(config, engine)


def grpo_step(actor: PPOActor, batch: TensorDict) -> tuple[float, float]:
    """Seconds and loss of one recompute + advantages + update (the main job's train step)."""
    sync(actor.engine.device)
    t0 = time.perf_counter()
    batch = {**batch, "prox_logp": actor.compute_logp(batch)}
    stats = actor.ppo_update(actor.compute_advantages(batch))
    sync(actor.engine.device)
    return time.perf_counter() - t0, stats[-1]["loss"]


def main(argv: list[str] | None = None) -> None:
    from tandemrl.models.make_tiny import ensure_tiny_model

    a = parse_args(argv)
    model = ensure_tiny_model(cache_dir(), "qwen2", corpus_path=a.data, **MODELS[a.model])
    batches = grpo_batches(a, model)
    try:
        actors = {"off": build_actor(a, model, "off"), "on": build_actor(a, model, "on")}
        secs = {k: 0.0 for k in actors}
        losses: dict[str, list[float]] = {k: [] for k in actors}
        for step, batch in enumerate(batches):
            for name in list(actors) if step % 2 == 0 else list(actors)[::-1]:
                s, loss = grpo_step(actors[name], batch)
                losses[name].append(loss)
                secs[name] += s if step >= a.warmup else 0.0
    finally:
        destroy_process_groups()
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[a.warmup :])
    shared = sum(sum(s.tokens for s in sharing_segments(b, "on")) for b in batches[a.warmup :])
    gap = max(abs(x - y) for x, y in zip(losses["off"], losses["on"], strict=True))
    print(
        f"{datetime.date.today()} model={a.model} params_dir={model} mixed_precision={a.mixed_precision} "
        f"threads={torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n"
        f"{a.prompts} prompts x {a.samples} samples x {a.new_tokens} new tokens, max_tokens_per_mb="
        f"{a.max_tokens_per_mb}, {a.steps} timed steps; tokens/step unshared {tokens / a.steps:.0f}, "
        f"shared {shared / a.steps:.0f} ({shared / tokens:.2f}x)"
    )
    for name in actors:
        print(f"prefix_sharing={name:<3}  {secs[name] / a.steps:7.3f} s/step")
    print(f"speed-up on/off: {secs['off'] / secs['on']:.2f}x; max |loss gap| {gap:.2e}; load_avg {os.getloadavg()}")


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("prefix_sharing"):
        main()
