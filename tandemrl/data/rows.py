"""Reading dataset splits: JSONL scanning with file/row errors, row validation, sharding, length limits.

Heavy libraries (datasets, torch, torchdata) are imported inside the functions so that
`import tandemrl.data` stays cheap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandemrl.models.hf import is_plausible_hub_id

if TYPE_CHECKING:
    from datasets import Dataset


DATASET_TYPES = ("sft", "rl")


# ----------------------------------------------------------------------------- splits


def split_file(path: str, split: str) -> str:
    """Where a local dataset directory keeps `split`."""
    return os.path.join(os.path.expanduser(path), f"{split}.jsonl")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or not is_plausible_hub_id(path)


def _field_problem(row: Any, field: str) -> str | None:
    """Why ``row[field]`` is not a usable text field, or None."""
    value = row.get(field) if isinstance(row, dict) else None
    if value is None:
        return f"required field {field!r} is missing"
    if not isinstance(value, str):
        return f"field {field!r} must be a string, got {type(value).__name__}"
    if not value.strip():
        return f"field {field!r} is empty"
    return None


def scan_jsonl(file: str, required: Sequence[str] = (), max_rows: int | None = None) -> int:
    """Check a JSON-lines file row by row and return its number of rows (at most ``max_rows``).

    Raises one line naming the file and the first problem: a byte that is not UTF-8 (line and
    byte offset), a line that is not JSON or not an object, a missing/blank ``required`` field
    (0-based row, as in :func:`validate_rows`), or no rows at all. Arrow's own errors name neither.
    """
    rows = offset = 0
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if max_rows is not None and rows >= max_rows:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{file}: line {lineno}: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} "
                    "is not valid UTF-8 (save the file as UTF-8)"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}: line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{file}: line {lineno}: expected a JSON object, got {type(row).__name__}")
            for field in required:
                problem = _field_problem(row, field)
                if problem is not None:
                    raise ValueError(f"{file}: row {rows}: {problem}")
            rows += 1
    if rows == 0:
        raise ValueError(f"{file}: empty (no JSON rows); a split file holds one JSON object per line")
    return rows


def _local_split_file(path: str, split: str) -> str | None:
    """The split's file for a local directory, None for a hub id; a missing dir or file raises naming it."""
    if os.path.isdir(os.path.expanduser(path)):
        file = split_file(path, split)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"dataset split file not found: {file} (split {split!r} of {path})")
        return file
    if _looks_local(path):
        raise FileNotFoundError(f"dataset directory not found: {path}")
    return None


def load_split(path: str, split: str, max_samples: int | None = None, *, name: str | None = "main") -> Dataset:
    """One split of a dataset: `{path}/{split}.jsonl` for a local directory, else a hub dataset.

    `name` is the hub config (GSM8K's is "main"). `max_samples` keeps the first N rows.
    A local file is checked first with :func:`scan_jsonl`, so a broken one is named precisely.
    """
    from datasets import load_dataset

    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples={max_samples} must be positive (or None for all rows)")
    file = _local_split_file(path, split)
    if file is not None:
        scan_jsonl(file)
        try:
            ds = load_dataset("json", data_files=file, split="train")
        except Exception as e:  # e.g. a column whose type changes between rows
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"{file}: could not be loaded as JSON lines ({type(e).__name__}: {first})") from e
    else:
        ds = load_dataset(path, name=name, split=split)
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(max_samples))
    return ds


def dataset_source(path: str, split: str) -> str:
    """How errors name a split: its file when local, else `hub_id[split]`."""
    return split_file(path, split) if os.path.isdir(os.path.expanduser(path)) else f"{path}[{split}]"


def validate_rows(ds: Dataset, required: Sequence[str] = ("question", "answer"), source: str = "dataset") -> None:
    """Fail on the first row whose required field is missing, not a string, or blank."""
    columns = set(ds.column_names)
    values = {f: (list(ds[f]) if f in columns else None) for f in required}
    for idx in range(len(ds)):
        for field in required:
            col = values[field]
            problem = _field_problem({field: None if col is None else col[idx]}, field)
            if problem is not None:
                raise ValueError(f"{source}: row {idx}: {problem}")


def shard_for_rank(ds: Dataset, rank: int, world_size: int, source: str = "dataset") -> Dataset:
    """This DP rank's contiguous shard; shards are trimmed to equal size.

    Equal shards give every rank the same number of batches, so no rank waits forever
    in a collective at the end of an epoch.
    """
    from datasets.distributed import split_dataset_by_node

    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank={rank} for world_size={world_size}")
    usable = len(ds) - len(ds) % world_size
    if usable == 0:
        raise ValueError(f"{source}: {len(ds)} samples cannot be split over {world_size} ranks")
    if usable < len(ds):
        ds = ds.select(range(usable))
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


# ----------------------------------------------------------------------------- length limit

TOO_LONG_POLICIES = ("drop", "error")
# A tokenizer without a real limit reports this huge sentinel as model_max_length.
_NO_LIMIT = 10**8


def length_limit(max_length: int | None, context_length: int | None) -> tuple[int, str] | None:
    """The token limit that applies (the smaller of the two) and how messages name it; None if neither is set."""
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length={max_length} must be positive (or None for the model's context)")
    if context_length is not None and (max_length is None or context_length < max_length):
        return context_length, f"the model context of {context_length}"
    if max_length is not None:
        return max_length, f"max_length={max_length}"
    return None


def enforce_length_limit(
    ds: Dataset,
    lengths: Sequence[int],
    limit: tuple[int, str] | None,
    on_too_long: str,
    source: str,
    *,
    rank: int = 0,
    split: str = "train",
) -> Dataset:
    """Drop (``on_too_long="drop"``) or refuse (``"error"``) the rows whose length is over ``limit``.

    Drop prints ``<source>: dropped N of M rows longer than <limit> tokens`` once (rank 0) and records
    N as the scalar ``data/<split>/dropped_too_long`` for the first logged step. Error raises one line
    naming the file, the first such row (0-based) and its length.
    """
    if on_too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"on_too_long={on_too_long!r} is not one of {', '.join(TOO_LONG_POLICIES)}")
    if limit is None:
        return ds
    cap, name = limit
    too_long = [i for i, n in enumerate(lengths) if n > cap]
    if too_long and on_too_long == "error":
        i = too_long[0]
        raise ValueError(
            f"{source}: row {i}: {lengths[i]} tokens, longer than {name} ({len(too_long)} of {len(ds)} rows are; "
            "on_too_long=drop skips them)"
        )
    from tandemrl.utils import stats_tracker

    stats_tracker.get().scalar(**{f"data/{split}/dropped_too_long": len(too_long)})
    if not too_long:
        return ds
    if rank == 0:
        print(f"{source}: dropped {len(too_long)} of {len(ds)} rows longer than {name} tokens", flush=True)
    dropped = set(too_long)
    return ds.select([i for i in range(len(ds)) if i not in dropped], keep_in_memory=True)


def tokenizer_context(tokenizer: Any) -> int | None:
    """The tokenizer's ``model_max_length`` when it is a real limit (transformers uses a huge sentinel otherwise)."""
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < _NO_LIMIT else None
