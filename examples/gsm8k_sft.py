"""Supervised fine-tuning on GSM8K answers (loss on answer tokens only).

    torchrun --standalone --nproc_per_node=2 examples/gsm8k_sft.py --config examples/gsm8k_sft.yaml \
        train_dataset.path=../shared/data/gsm8k valid_dataset.path=../shared/data/gsm8k

The loop (engine, data, saver, evaluator, logger, recovery) is ``tandemrl.trainers.sft.SFTTrainer``;
``recover.mode=auto|resume`` continues after the last recoverable checkpoint.
"""

from __future__ import annotations

from tandemrl.configs import SFTConfig
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.sft import SFTTrainer
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, SFTConfig)
    with SFTTrainer(config) as trainer:
        trainer.train()


if __name__ == "__main__":
    run_main(main)
