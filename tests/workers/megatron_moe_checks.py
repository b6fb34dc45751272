"""torchrun worker for the Megatron MoE tests (2 ranks): every configuration in one launch, each engine
destroyed before the next (megatron's parallel_state is rebuilt per layout).

Sections (``--sections``, default all):
``aux``: the tiny MoE with the load-balancing aux loss on (``--aux-moe``): 3 SFT steps at d2 with 1 and 2
micro-batches, at p2 and at t2 with 2, on a batch whose micro-batches all hold the same sequences (so every
micro-batch has the same routing statistics and the aux loss itself is split-invariant); and p2 against t2
(one DP rank each: the same micro-batches) on an ordinary batch.
``etp``: the hybrid ``megatron:(attn:d2|ffn:t2)`` (experts split by expert-TP) against ``megatron:d2``:
3 SFT steps and the full HF export after them.
``tp``: ``megatron:t2`` and ``megatron:(attn:t2|ffn:e2)`` (MoE under TP: sequence parallel on the local spec)
against ``megatron:d2``: 3 SFT steps and the HF export; and t2 in the ``aux`` runs.
Rank 0 writes ``moe.pt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from fsdp_checks import make_batch
from megatron_checks import engine
from parity_checks import dp_slice

from tandemrl.algorithms.sft import SFTActor
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.packing import plan_padded_batch
from tandemrl.engines.teardown import destroy_process_groups

SEEDS = (200, 201, 202)


def repeated_batch(seed: int) -> dict[str, torch.Tensor]:
    """Two sequences of different lengths, 4 times each ([a, b] * 4).

    Every DP rank and every micro-batch split (1 or 2 per rank at d2, 2 at p2) then gets the same
    multiset of sequences per micro-batch, so the per-micro-batch aux loss is the same number
    whatever the split and only its weighting can differ.
    """
    for s in range(seed, seed + 100):
        pair = make_batch(s, n=2)
        lens = pair["attention_mask"].sum(1)
        if int(lens[0]) != int(lens[1]):
            return {k: v.repeat(4, *([1] * (v.dim() - 1))) for k, v in pair.items()}
    raise AssertionError("no seed gives two different lengths")


def even_batch(seed: int) -> dict[str, torch.Tensor]:
    """``make_batch`` with every odd length cut by one token: no micro-batch needs padding under t2."""
    batch = {k: v.clone() for k, v in make_batch(seed).items()}
    lens = batch["attention_mask"].sum(1)
    for i in torch.nonzero(lens % 2).flatten().tolist():
        last = int(lens[i]) - 1
        batch["attention_mask"][i, last] = False
        batch["loss_mask"][i, last] = 0
        batch["input_ids"][i, last] = 0
    return batch


def run(allocation: str, model: str, n_mbs: int, batch_fn: Any, export: bool = False) -> dict[str, Any]:
    """3 SFT steps: each step's stats (with the exported tracker stats) and, optionally, the HF export."""
    e = engine(allocation, model, n_mbs=n_mbs)
    e.export_stats()  # drop what earlier engines recorded
    steps = []
    for seed in SEEDS:
        stats = SFTActor(e).train_lm(dp_slice(e, batch_fn(seed)))
        steps.append({**stats, "exported": e.export_stats()})
    out: dict[str, Any] = {"steps": steps}
    if export:
        keep = dist.get_rank() == 0
        out["hf"] = {n: t.detach().cpu().clone() for n, t in e.iter_hf_params() if keep}
    e.destroy()
    return out


def main() -> None:
    init_default_process_group()
    out: dict[str, Any] = {}
    sections = ARGS.sections.split(",")
    if "aux" in sections:
        # Equal routing statistics in every micro-batch: the whole update is split- and layout-invariant.
        out["aux_repeated"] = {
            "d2_mbs1": run("megatron:d2", ARGS.aux_moe, 1, repeated_batch),
            "d2_mbs2": run("megatron:d2", ARGS.aux_moe, 2, repeated_batch),
            "p2_mbs2": run("megatron:p2", ARGS.aux_moe, 2, repeated_batch),
            # Sequence parallel: each TP rank routes half of every micro-batch (even lengths: no padding).
            "t2_mbs2": run("megatron:t2", ARGS.aux_moe, 2, repeated_batch),
        }
        # Distinct micro-batches with distinct weights and aux losses: the same micro-batches (one DP rank)
        # through the pipeline schedule and through the plain loop must weight them alike.
        out["aux_even"] = {
            "p2_mbs2": run("megatron:p2", ARGS.aux_moe, 2, even_batch),
            "t2_mbs2": run("megatron:t2", ARGS.aux_moe, 2, even_batch),
        }
    if "etp" in sections:
        out["etp"] = {
            "d2": run("megatron:d2", ARGS.moe, 2, make_batch, export=True),
            "hybrid": run("megatron:(attn:d2|ffn:t2)", ARGS.moe, 2, make_batch, export=True),
        }
    if "tp" in sections:
        # t2 has one DP rank: its packed micro-batch lengths, some odd, so padded to a multiple of tp.
        out["tp_mb_lengths"] = [
            [int(lengths[g].sum()) for g in plan_padded_batch(b, 2)]
            for b in (make_batch(seed) for seed in SEEDS)
            for lengths in [b["attention_mask"].sum(1)]
        ]
        out["tp"] = {
            "d2": run("megatron:d2", ARGS.moe, 2, make_batch, export=True),
            "t2": run("megatron:t2", ARGS.moe, 2, make_batch, export=True),
            # attention TP with expert parallelism over the same two ranks
            "t2|e2": run("megatron:(attn:t2|ffn:e2)", ARGS.moe, 2, make_batch, export=True),
        }
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(ARGS.out, "moe.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--moe", required=True, help="tiny MoE model dir (no aux loss)")
    p.add_argument("--aux-moe", default="", help="the same model with output_router_logits=True")
    p.add_argument("--sections", default="aux,etp,tp")
    p.add_argument("--out", required=True)
    ARGS = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    main()
    destroy_process_groups()
