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
    batch_size: int = field(default=8, metadata={"help": "Global batch size (prompts), split over DP ranks.", "min": 1})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle each epoch."})
    drop_last: bool = field(default=True, metadata={"help": "Drop the last incomplete batch."})
    num_workers: int = field(default=0, metadata={"help": "Dataloader worker processes.", "min": 0})
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Token limit of a sample (the templated prompt for type rl, prompt + answer for sft); "
            "None means the model's context (max_position_embeddings). The model's context always applies.",
            "min": 1,
        },
    )
    on_too_long: str = field(
        default="drop",
        metadata={
            "help": "A sample over the limit: 'drop' skips it, printing the count once at start and logging it as "
            "data/<split>/dropped_too_long; 'error' stops the run naming the file, row and lengths.",
            "choices": ["drop", "error"],
        },
    )
    max_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N rows (quick runs).", "min": 1}
    )
