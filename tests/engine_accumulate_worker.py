"""Worker of tests/integration/test_engine_accumulate.py (one torchrun rank): the same batch trained by ``train_batch`` and, on
a second engine from the same weights, by two ``accumulate_gradients`` calls (one per half) and ``apply_gradients``, twice each; and by the latter on an
engine built with other Adam parameters and then given the first's by ``set_optimizer_params``. Writes the initial
weights and the three engines' trained weights to OUT."""

from __future__ import annotations

import sys

import torch

from tandemrl.api.types import FinetuneSpec
from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
from tandemrl.engines.base import init_default_process_group
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.models.functional import gather_logprobs


def main(model_dir: str, out: str) -> None:
    init_default_process_group()
    gen = torch.Generator().manual_seed(0)
    lens = [7, 12, 5, 9]
    ids = torch.randint(3, 200, (len(lens), max(lens)), generator=gen)
    mask = torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]
    batch = {"input_ids": ids, "attention_mask": mask, "target": torch.roll(ids, -1, 1)}

    def loss_fn(logits: torch.Tensor, mb: dict) -> torch.Tensor:
        return -gather_logprobs(logits, mb["target"]).mean()

    def weight(mb: dict) -> float:
        return float(mb["input_ids"].numel())

    weights = {}
    # eps 1e-3: Adam's first step is lr * g / (|g| + eps); at the default 1e-8 a near-zero gradient turns a
    # last-bit difference of summation order into a step of up to lr (measured: 8e-5 apart)
    wanted = OptimizerConfig(lr=1e-2, eps=1e-3)
    # "params": built with other Adam parameters, clipping and a decaying schedule (lr 0 at its second step),
    # then given ``wanted``'s by set_optimizer_params: it must train as the engine built with them
    other = OptimizerConfig(lr=5e-2, eps=1e-8, beta2=0.5, weight_decay=0.1, gradient_clipping=1e-4)
    other.lr_scheduler_type = "linear"
    for how in ("train_batch", "accumulate", "params"):
        cfg = TrainEngineConfig(path=model_dir, mixed_precision=None, optimizer=other if how == "params" else wanted)
        engine = FSDPEngine(cfg)
        engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
        weights.setdefault("initial", {k: v.clone() for k, v in engine.full_state_dict().items()})
        if how == "params":
            engine.set_optimizer_params(
                wanted.lr, (wanted.beta1, wanted.beta2), wanted.eps, wanted.weight_decay, wanted.gradient_clipping
            )
        for _ in range(2):  # two steps: the second runs after the schedule has advanced
            if how == "train_batch":
                engine.train_batch(batch, loss_fn, weight)
                continue
            for half in (slice(0, 2), slice(2, 4)):
                engine.accumulate_gradients({k: v[half] for k, v in batch.items()}, loss_fn, weight, float(sum(lens)))
            engine.apply_gradients()
        weights[how] = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.destroy()
    torch.save(weights, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
