"""torchrun worker of tests/integration/test_consistency.py: trainer vs real vLLM logprobs per backend x precision.

Each cell of ``--cells`` (JSON: name, allocation, mixed_precision, addr) builds its engine
from the HF model, resets its server to the same HF weights (version 0), and measures the
mean and max |trainer - server| logprob of the tokens the server sampled at every
``--temperatures`` value (trainer: ``PPOActor.compute_logp`` at that temperature):

* ``step0``: both loaded the HF checkpoint;
* 3 SFT steps, pushed by disk (step 1), collective (step 2), collective (step 3) -> ``step3-collective``;
  the same step-3 weights pushed again by disk -> ``step3-disk``. Every full push replaces all of the
  server's weights, so each transport is gated on the trained weights.

Controls (the gate can fail): the trained engine scoring the step-0 samples (a lost update), and the
step-0 engine scoring the lowest temperature's samples at T=1 (a temperature ignored).
Rank 0 samples and broadcasts the responses, so every rank (TP peers too) scores the same batch.
Rank 0 writes ``<cell>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from sync_checks import (
    generate,
    generated_positions,
    make_engine,
    make_rollout,
    memorize_batch,
    padded,
    sampling_requests,
)

from tandemrl.algorithms.offpolicy import mismatch_token_stats
from tandemrl.algorithms.ppo import PPOActor
from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.engine import TrainEngine
from tandemrl.api.inference import ModelResponse, WeightUpdateMeta
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.rollout.controller import RolloutController
from tandemrl.weights.plan import collective_update

Samples = dict[float, list[ModelResponse]]


def sample(args: argparse.Namespace, rollout: RemoteInferenceClient, vocab: int, tag: str, version: int) -> Samples:
    """Rank 0 samples at every temperature (the same seeded prompts each time); all ranks get the responses."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        g = torch.Generator().manual_seed(args.seed)
        box[0] = {
            t: generate(rollout, sampling_requests(args, vocab, g, f"{tag}-{t}", temperature=t))
            for t in args.temperatures
        }
    dist.broadcast_object_list(box, src=0)
    for resps in box[0].values():
        versions = {v for r in resps for v in r.output_versions}
        assert versions == {version}, f"{tag}: tokens sampled by versions {versions}, expected {version}"
    return box[0]


def gap(args: argparse.Namespace, engine: TrainEngine, resps: list[ModelResponse], temp: float) -> dict[str, float]:
    """Mean and max |trainer - server| logprob over the generated tokens (trainer at ``temp``), and ``kl_k3``:
    the mean k3 estimate of KL(server || trainer), the ``offpolicy/kl_k3`` a training run logs."""
    batch = padded([r.input_tokens + r.output_tokens for r in resps])
    logp = PPOActor(PPOActorConfig(temperature=temp), engine).compute_logp(batch)
    pos = generated_positions(args, resps, {"trainer": logp})
    trainer, server = torch.tensor(pos["trainer"]), torch.tensor(pos["server"])
    diff = (trainer - server).abs()
    k3 = mismatch_token_stats(trainer, server, torch.ones_like(trainer, dtype=torch.bool))["kl_k3"]
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": diff.numel(), "kl_k3": float(k3.mean())}


def gaps(args: argparse.Namespace, engine: TrainEngine, samples: Samples) -> dict[float, dict[str, float]]:
    return {t: gap(args, engine, resps, t) for t, resps in samples.items()}


def run_cell(args: argparse.Namespace, cell: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    engine = make_engine(args.model, args.lr, cell["allocation"], cell["mixed_precision"], cell.get("overrides"))
    rollout = make_rollout(cell["addr"], setup_timeout=cell.get("setup_timeout", 60.0))  # a server may be starting
    rank, vocab = dist.get_rank(), int(engine.model_config.vocab_size)
    disk = WeightUpdateMeta.from_disk(os.path.join(args.out, cell["name"]), "sync", "disk")
    alloc = parse_allocation(f"vllm:d1+{cell['allocation']}")
    box = [collective_update(alloc, group_addr="127.0.0.1", bucket_size_mb=1)]
    dist.broadcast_object_list(box, src=0)  # one rendezvous port for every rank
    collective = box[0]
    controller = RolloutController(rollout, engine, rollout.config, disk)
    rec: dict[str, Any] = {"gaps": {}, "controls": {}}
    try:
        if rank == 0:  # the server on the HF checkpoint the engine loaded
            rollout.update_weights_from_disk(WeightUpdateMeta(type="disk", path=args.model, version=0)).result()
        dist.barrier()
        step0 = sample(args, rollout, vocab, f"{cell['name']}-s0", 0)
        rec["gaps"]["step0"] = gaps(args, engine, step0)
        low = min(args.temperatures)
        rec["controls"]["temperature"] = {low: gap(args, engine, step0[low], 1.0)}
        batch = memorize_batch(vocab, seed=7)
        dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_world_size  # TP peers share rows
        shard = {k: v[dp_rank::dp_size] for k, v in batch.items()}
        rec["losses"] = []
        for meta in (disk, collective, collective):
            rec["losses"].append(SFTActor(engine).train_lm(shard)["loss"])
            controller.push_weights(meta=meta)
        rec["gaps"]["step3-collective"] = gaps(args, engine, sample(args, rollout, vocab, f"{cell['name']}-c", 3))
        controller.push_weights(meta=disk)  # the same step-3 weights, now from disk
        rec["gaps"]["step3-disk"] = gaps(args, engine, sample(args, rollout, vocab, f"{cell['name']}-d", 4))
        rec["controls"]["stale"] = {t: gap(args, engine, resps, t) for t, resps in step0.items()}
        dist.barrier()
    finally:
        controller.destroy()
        rollout.destroy()
        engine.destroy()
    rec["seconds"] = time.perf_counter() - start
    return rec


def main(args: argparse.Namespace) -> None:
    init_default_process_group()
    for cell in json.loads(args.cells):
        rec = run_cell(args, cell)
        if dist.get_rank() == 0:
            torch.save(rec, os.path.join(args.out, f"{cell['name']}.pt"))
            print(f"{cell['name']}: {rec['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument(
        "--cells",
        required=True,
        help="JSON list of {name, allocation, mixed_precision, overrides, addr, setup_timeout}",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--samples", type=int, default=8, help="completions per temperature and checkpoint")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="prompts' seed")
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    main(a)
    destroy_process_groups()
