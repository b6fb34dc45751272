"""Datasets (GSM8K and registered ones), dataloaders and batch padding.

Import-light: datasets/torch/torchdata load only when a function is called.
"""

from tandemrl.data.gsm8k import get_gsm8k_rl_dataset, get_gsm8k_sft_dataset
from tandemrl.data.loader import (
    collate_as_list,
    create_dataloader,
    dataset_from_config,
    get_custom_dataset,
    pad_sequences_to_tensors,
    register_dataset,
)
from tandemrl.data.rows import load_split, shard_for_rank, validate_rows

__all__ = [
    "collate_as_list",
    "create_dataloader",
    "dataset_from_config",
    "get_custom_dataset",
    "get_gsm8k_rl_dataset",
    "get_gsm8k_sft_dataset",
    "load_split",
    "pad_sequences_to_tensors",
    "register_dataset",
    "shard_for_rank",
    "validate_rows",
]
