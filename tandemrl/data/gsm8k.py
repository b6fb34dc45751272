"""GSM8K (question/answer rows) as SFT samples or RL prompts, sharded by DP rank.

Rows are tokenized and length-filtered on the whole split *before* sharding, so every
rank ends up with the same number of samples (see `shard_for_rank`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandemrl.data.loader import dataset_source, load_split, shard_for_rank, validate_rows

if TYPE_CHECKING:
    from datasets import Dataset

REQUIRED_FIELDS = ("question", "answer")


def user_messages(question: str) -> list[dict[str, str]]:
    """The chat a GSM8K question becomes: a single user turn."""
    return [{"role": "user", "content": question}]


def render_prompts(tokenizer: Any, questions: list[str]) -> list[list[int]]:
    """Token ids of each question as a chat prompt ending with the assistant header."""
    texts = [
        tokenizer.apply_chat_template(user_messages(q), tokenize=False, add_generation_prompt=True) for q in questions
    ]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length={max_length} must be positive (or None for no limit)")


def _load_valid(path: str, split: str, max_samples: int | None) -> tuple[Dataset, str]:
    source = dataset_source(path, split)
    ds = load_split(path, split, max_samples=max_samples)
    validate_rows(ds, REQUIRED_FIELDS, source=source)
    return ds, source


def _nonempty(ds: Dataset, source: str, max_length: int | None) -> Dataset:
    if len(ds) == 0:
        raise ValueError(f"{source}: no sample fits max_length={max_length}")
    return ds


def get_gsm8k_sft_dataset(
    path: str,
    split: str,
    tokenizer: Any,
    rank: int,
    world_size: int,
    max_length: int | None = None,
    max_samples: int | None = None,
) -> Dataset:
    """Samples {input_ids, loss_mask}: chat prompt (mask 0) + answer + eos (mask 1)."""
    _check_max_length(max_length)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token; SFT samples need one to end the answer")
    ds, source = _load_valid(path, split, max_samples)

    def process(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        prompts = render_prompts(tokenizer, batch["question"])
        answers = tokenizer(batch["answer"], add_special_tokens=False)["input_ids"]
        input_ids = [p + a + [eos] for p, a in zip(prompts, answers, strict=True)]
        loss_mask = [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(prompts, answers, strict=True)]
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    ds = ds.map(process, batched=True, remove_columns=ds.column_names, keep_in_memory=True)
    if max_length is not None:
        ds = ds.filter(lambda ids: len(ids) <= max_length, input_columns="input_ids", keep_in_memory=True)
    return shard_for_rank(_nonempty(ds, source, max_length), rank, world_size, source)


def get_gsm8k_rl_dataset(
    path: str,
    split: str,
    tokenizer: Any,
    rank: int,
    world_size: int,
    max_length: int | None = None,
    max_samples: int | None = None,
) -> Dataset:
    """Prompts {messages, question, answer}; `max_length` bounds the templated prompt's tokens."""
    _check_max_length(max_length)
    ds, source = _load_valid(path, split, max_samples)

    def process(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "messages": [user_messages(q) for q in batch["question"]],
            "question": list(batch["question"]),
            "answer": list(batch["answer"]),
        }
        if max_length is not None:
            out["prompt_len"] = [len(p) for p in render_prompts(tokenizer, batch["question"])]
        return out

    ds = ds.map(process, batched=True, remove_columns=ds.column_names, keep_in_memory=True)
    if max_length is not None:
        ds = ds.filter(lambda n: n <= max_length, input_columns="prompt_len", keep_in_memory=True)
        ds = ds.remove_columns("prompt_len")
    return shard_for_rank(_nonempty(ds, source, max_length), rank, world_size, source)
