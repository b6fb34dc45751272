"""torchrun worker for tests/integration/test_deepspeed_weight_sync.py: a ZeRO-3 trainer updating a real vLLM server.

One process pair does both transports, so DeepSpeed starts once: train a few SFT steps
(2 ranks: each holds half of every parameter), export HF, then

1. disk update (labelled version 1) -> the server's greedy outputs -> ``disk/update.pt``;
2. the server back on the original weights (label 0), which must give the old outputs again;
3. bucketed collective update of the same weights (labelled version 2; 1 MB ZeRO-3 gathers and
   1 MB broadcast buckets, so several of each) -> ``collective/update.pt``;
4. ``RolloutController.destroy`` then a new controller on the same group port and one more update (label 3).

Each record has the fields ``test_weight_sync.check_update_record`` reads; ``exported`` is
copied next to both (rank 0 writes everything).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
from sync_checks import (
    RecordingClient,
    gather_to_rank0,
    greedy_outputs,
    make_rollout,
    memorize_batch,
    version_label,
)

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.inference import WeightUpdateMeta
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import DeepSpeedEngineConfig, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.deepspeed import DeepSpeedEngine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.rollout.controller import RolloutController
from tandemrl.weights.plan import collective_update
from tandemrl.weights.wire import parse_buckets_json


def make_engine(model: str, lr: float) -> DeepSpeedEngine:
    cfg = TrainEngineConfig(
        path=model,
        mixed_precision=None,
        optimizer=OptimizerConfig(lr=lr, gradient_clipping=0.0),
        deepspeed=DeepSpeedEngineConfig(zero_stage=3, param_gather_bucket_mb=1),
    )
    engine = DeepSpeedEngine(cfg)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=1))
    return engine


def push(
    controller: RolloutController,
    rollout: RemoteInferenceClient,
    meta: WeightUpdateMeta,
    prompts: list,
    before: list | None = None,
) -> dict:
    """Update the server to ``engine.get_version() + 1``; record labels and greedy outputs around it
    (``before``: the outputs just measured on the current server weights, if any)."""
    rank = dist.get_rank()
    record: dict[str, object] = {}
    if rank == 0:
        record["before"] = before if before is not None else greedy_outputs(rollout, prompts)
        record["label_before"] = version_label(rollout)
    dist.barrier()
    start = time.perf_counter()
    controller.push_weights(meta=meta)  # labelled engine version + 1; engine and client set to it
    record["update_seconds"] = time.perf_counter() - start
    record["rank_versions"] = gather_to_rank0((controller.engine.get_version(), rollout.get_version()))
    if rank == 0:
        s = controller._pusher.last_stats  # the pusher's weight_sync/* figures of this push
        assert s is not None
        record["sync"] = {"bytes": s.bytes, "full_bytes": s.full_bytes, "seconds": s.seconds}
        record["after"] = greedy_outputs(rollout, prompts)
        record["label_after"] = version_label(rollout)
        record["client_version"] = rollout.get_version()
    dist.barrier()
    return record


def save_record(record: dict, out: str, name: str) -> None:
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    shutil.copytree(os.path.join(out, "exported"), os.path.join(d, "exported"), dirs_exist_ok=True)
    torch.save(record, os.path.join(d, "update.pt"))


def main(args: argparse.Namespace) -> None:
    engine = make_engine(args.model, lr=args.lr)
    assert engine.zero_stage == 3
    # ZeRO-3 really partitions: this rank holds a strict part of each large parameter.
    big = max(engine.model.module.parameters(), key=lambda p: p.ds_numel)
    assert 0 < big.ds_tensor.numel() < big.ds_numel, (big.ds_tensor.numel(), big.ds_numel)
    client = RecordingClient()
    rollout = make_rollout(args.addr, client)
    rank = dist.get_rank()
    with open(args.prompts) as f:
        prompts = json.load(f)
    disk = WeightUpdateMeta.from_disk(os.path.join(args.out, "sync"), "weight_sync", "disk")
    collective = collective_update(
        parse_allocation("vllm:d1+deepspeed:d2"), group_addr="127.0.0.1", comm_backend="gloo", bucket_size_mb=1
    )
    box = [collective]
    dist.broadcast_object_list(box, src=0)  # one rendezvous port for every rank
    controller = RolloutController(rollout, engine, rollout.config, disk)
    try:
        batch = memorize_batch(int(engine.model_config.vocab_size), seed=7)
        shard = {k: v[rank :: dist.get_world_size()] for k, v in batch.items()}
        losses = [SFTActor(engine).train_lm(shard)["loss"] for _ in range(args.steps)]
        engine.save(SaveLoadMeta(path=os.path.join(args.out, "exported"), weight_format="hf"))

        disk_record = {"losses": losses, **push(controller, rollout, disk, prompts)}  # labelled 1
        if rank == 0:
            restore = WeightUpdateMeta(type="disk", path=args.model, version=0)
            rollout.update_weights_from_disk(restore).result()
            disk_record["restored"] = greedy_outputs(rollout, prompts)
        dist.barrier()
        n_rpcs = len(client.rpcs)
        restored = disk_record.get("restored")  # rank 0 only; the other ranks do not generate
        coll_record = {"losses": losses, **push(controller, rollout, box[0], prompts, restored)}  # labelled 2
        if rank == 0:
            # Tensors per bucket, as the server was told in its tandemrl_recv_weights call(s).
            recv = [r for r in client.rpcs[n_rpcs:] if r["method"] == "tandemrl_recv_weights"]
            coll_record["recv_rpcs"] = len(recv)  # one per update: every bucket's specs in one call
            coll_record["bucket_sizes"] = [len(b) for r in recv for b in parse_buckets_json(r["kwargs"]["meta_json"])]
            coll_record["n_params"] = len(engine.hf_param_specs())

        # destroy() closes the weight-update group, so rank 0's store frees the group port:
        # a new controller with the same meta (same port) updates again. Destroyed, it refuses updates.
        controller.destroy()
        try:
            controller.push_weights(meta=box[0])
        except RuntimeError as e:
            coll_record["disconnected_error"] = str(e)
        controller = RolloutController(rollout, engine, rollout.config, box[0])
        controller.push_weights(3)
        if rank == 0:
            coll_record["reconnected_label"] = version_label(rollout)
            save_record(disk_record, args.out, "disk")
            save_record(coll_record, args.out, "collective")
        dist.barrier()
    finally:
        controller.destroy()  # closes the weight-update group
        engine.destroy()
        rollout.destroy()
        client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--addr", required=True, help="host:port of the vLLM server")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id prompts for the greedy comparison")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    main(a)
    destroy_process_groups()
