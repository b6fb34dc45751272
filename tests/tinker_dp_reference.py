"""The data-parallel reference of tests/e2e/test_tinker_launcher.py: the same LoRA training as its SDK client, on
``tandemrl.tinker.trainer.EngineTrainer`` in one process (a world of one, no server).

``python tinker_dp_reference.py MODEL_DIR OUT_DIR SPEC_JSON`` with SPEC_JSON ``{"rank", "seed", "lr", "steps",
"seqs"}``: one adapter, ``steps`` cross_entropy forward_backward + optim_step pairs on ``seqs`` (weight 1 on every
target), then its state saved under OUT_DIR as tinker-serve's ``save_weights`` writes it.
"""

from __future__ import annotations

import json
import sys

import torch

from tandemrl.tinker.trainer import ATTN, MLP, EngineTrainer


def main(model_dir: str, out_dir: str, spec: dict) -> None:
    trainer = EngineTrainer(model_dir, max_rank=8)
    trainer.add("ref", int(spec["rank"]), ATTN + MLP, int(spec["seed"]))
    data = [
        {
            "input_ids": torch.tensor(seq[:-1]),
            "target_tokens": torch.tensor(seq[1:]),
            "weights": torch.ones(len(seq) - 1),
        }
        for seq in spec["seqs"]
    ]
    for _ in range(int(spec["steps"])):
        trainer.forward_backward("ref", data, "cross_entropy", {}, True)
        trainer.optim_step("ref", {"learning_rate": float(spec["lr"])})
    trainer.save_state("ref", out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
