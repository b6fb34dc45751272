"""Config of a dataset and its dataloader."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DatasetConfig:
    """A dataset split and how it is batched."""

    path: str = field(
        default="openai/gsm8k",
        metadata={"help": "HF hub id, or a local directory holding {split}.jsonl files."},
    )
    type: str = field(default="sft", metadata={"help": "How rows are turned into samples.", "choices": ["sft", "rl"]})
    split: str = field(default="train", metadata={"help": "Split name (train/test)."})
    batch_size: int = field(default=8, metadata={"help": "Global batch size (prompts), split over DP ranks."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle each epoch."})
    drop_last: bool = field(default=True, metadata={"help": "Drop the last incomplete batch."})
    num_workers: int = field(default=0, metadata={"help": "Dataloader worker processes."})
    max_length: int | None = field(default=None, metadata={"help": "Drop samples longer than this many tokens."})
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N rows (quick runs)."})
