"""torchrun worker for the LoRA tests: FSDP2 + bf16 mixed precision with adapters on every rank.

Trains two SFT steps and writes (rank 0) the full weights before and after, the logits of a
probe batch, the adapter (PEFT) and the merged HF export under --out.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from fsdp_checks import make_batch, rank_slice

from tandemrl.algorithms.sft import SFTActor
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.engine import LoRAConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.teardown import destroy_process_groups


def build(model: str) -> FSDPEngine:
    cfg = TrainEngineConfig(
        path=model,
        mb_spec=MicroBatchSpec(n_mbs=2),
        mixed_precision="bfloat16",
        optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=1.0),
        lora=LoRAConfig(rank=4, alpha=8.0),
    )
    e = FSDPEngine(cfg)
    e.create_process_group()
    e.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=10))
    return e


def main(args: argparse.Namespace) -> None:
    e = build(args.model)
    trainable = sorted(n for n, p in e.model.named_parameters() if p.requires_grad)
    before = _raw(e)
    losses = [SFTActor(e).train_lm(rank_slice(make_batch(700 + step)))["loss"] for step in range(2)]
    after = _raw(e)
    exported = dict(e.iter_hf_params())  # the collective path's merged tensors
    probe = make_batch(999, n=4)
    logits = e.forward(probe)
    e.save(SaveLoadMeta(path=os.path.join(args.out, "adapter"), weight_format="peft"))
    e.save(SaveLoadMeta(path=os.path.join(args.out, "merged"), weight_format="hf", tokenizer_path=args.model))
    e.save(SaveLoadMeta(path=os.path.join(args.out, "dcp"), weight_format="dcp", with_optim=True))
    SFTActor(e).train_lm(rank_slice(make_batch(702)))
    stepped = _raw(e)
    e.destroy()
    resumed = build(args.model)  # fresh adapters, then the checkpoint's adapters and Adam states
    resumed.load(SaveLoadMeta(path=os.path.join(args.out, "dcp"), weight_format="dcp", with_optim=True))
    restored = _raw(resumed)
    SFTActor(resumed).train_lm(rank_slice(make_batch(702)))
    resumed_stepped = _raw(resumed)
    resumed.destroy()
    if dist.get_rank() == 0:
        result = {"trainable": trainable, "before": before, "after": after, "exported": exported}
        result.update(losses=losses, probe=probe, logits=logits, world=dist.get_world_size())
        result.update(restored=restored, stepped=stepped, resumed_stepped=resumed_stepped)
        torch.save(result, os.path.join(args.out, "lora.pt"))


def _raw(e: FSDPEngine) -> dict[str, torch.Tensor]:
    """Every tensor of the model (base and adapters) unsharded, under its own name."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in e.model.state_dict().items()
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--out", required=True, help="directory for lora.pt, adapter/ and merged/")
    torch.use_deterministic_algorithms(True)
    try:
        main(parser.parse_args())
    finally:
        destroy_process_groups()
