"""GSM8K (question/answer rows) as SFT samples or RL prompts, sharded by DP rank.

Rows are tokenized and length-filtered on the whole split *before* sharding, so every
rank ends up with the same number of samples (see `shard_for_rank`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandemrl.data.rows import (
    dataset_source,
    enforce_length_limit,
    length_limit,
    load_split,
    shard_for_rank,
    validate_rows,
)

if TYPE_CHECKING:
    from datasets import Dataset

REQUIRED_FIELDS = ("question", "answer")


# A row may also carry a ``system`` prompt (its chat starts with it) and any other fields, which RL prompts keep:
# the workflow hands them to the reward as keyword arguments (e.g. ``reasoning_gym``, tandemrl.data.reasoning_gym).
SYSTEM_FIELD = "system"


def user_messages(question: str, system: str | None = None) -> list[dict[str, str]]:
    """The chat a question becomes: a single user turn, after a system turn if ``system`` is non-empty."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": question}]


def render_prompts(tokenizer: Any, questions: list[str], systems: list[str | None] | None = None) -> list[list[int]]:
    """Token ids of each question (after its system prompt, if any) as a chat prompt ending with the assistant
    header."""
    systems = systems if systems is not None else [None] * len(questions)
    texts = [
        tokenizer.apply_chat_template(user_messages(q, s), tokenize=False, add_generation_prompt=True)
        for q, s in zip(questions, systems, strict=True)
    ]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _systems(batch: dict[str, list[Any]]) -> list[str | None]:
    return list(batch[SYSTEM_FIELD]) if SYSTEM_FIELD in batch else [None] * len(batch["question"])


def _load_valid(path: str, split: str, max_samples: int | None) -> tuple[Dataset, str]:
    source = dataset_source(path, split)
    ds = load_split(path, split, max_samples=max_samples)
    validate_rows(ds, REQUIRED_FIELDS, source=source)
    return ds, source


def _nonempty(ds: Dataset, source: str, limit: tuple[int, str] | None) -> Dataset:
    if len(ds) == 0:
        raise ValueError(f"{source}: no sample fits {limit[1] if limit else 'the length limit'}")
    return ds


def get_gsm8k_sft_dataset(
    path: str,
    split: str,
    tokenizer: Any,
    rank: int,
    world_size: int,
    max_length: int | None = None,
    max_samples: int | None = None,
    on_too_long: str = "drop",
    context_length: int | None = None,
) -> Dataset:
    """Samples {input_ids, loss_mask}: chat prompt (mask 0) + answer + eos (mask 1).

    Samples longer than ``max_length`` or ``context_length`` are dropped or refused (``on_too_long``).
    """
    limit = length_limit(max_length, context_length)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token; SFT samples need one to end the answer")
    ds, source = _load_valid(path, split, max_samples)

    def process(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        prompts = render_prompts(tokenizer, batch["question"], _systems(batch))
        answers = tokenizer(batch["answer"], add_special_tokens=False)["input_ids"]
        input_ids = [p + a + [eos] for p, a in zip(prompts, answers, strict=True)]
        loss_mask = [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(prompts, answers, strict=True)]
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    ds = ds.map(process, batched=True, remove_columns=ds.column_names, keep_in_memory=True)
    lengths = [len(ids) for ids in ds["input_ids"]] if limit is not None else []
    ds = enforce_length_limit(ds, lengths, limit, on_too_long, source, rank=rank, split=split)
    return shard_for_rank(_nonempty(ds, source, limit), rank, world_size, source)


def get_gsm8k_rl_dataset(
    path: str,
    split: str,
    tokenizer: Any,
    rank: int,
    world_size: int,
    max_length: int | None = None,
    max_samples: int | None = None,
    on_too_long: str = "drop",
    context_length: int | None = None,
) -> Dataset:
    """Prompts {id, messages, question, answer, and the row's other fields}; ``id`` is the 0-based row of the
    split, identical on every rank and run. The templated prompt's tokens are bounded by ``max_length`` and
    ``context_length`` (over: dropped or refused, by ``on_too_long``)."""
    limit = length_limit(max_length, context_length)
    ds, source = _load_valid(path, split, max_samples)
    for name in ("id", "messages"):
        if name in ds.column_names:
            raise ValueError(f"{source}: rows have a field {name!r}, which the RL prompt sets itself; rename it")

    def process(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        systems = _systems(batch)
        return {
            "id": list(indices),
            "messages": [user_messages(q, s) for q, s in zip(batch["question"], systems, strict=True)],
        }

    ds = ds.map(process, batched=True, with_indices=True, keep_in_memory=True)
    systems = ds[SYSTEM_FIELD] if SYSTEM_FIELD in ds.column_names else None
    lengths = [len(p) for p in render_prompts(tokenizer, ds["question"], systems)] if limit is not None else []
    ds = enforce_length_limit(ds, lengths, limit, on_too_long, source, rank=rank, split=split)
    return shard_for_rank(_nonempty(ds, source, limit), rank, world_size, source)
