"""Loading dataset splits, a registry of dataset builders, dataloaders and batch padding.

Heavy libraries (datasets, torch, torchdata) are imported inside the functions so that
`import tandemrl.data` stays cheap.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandemrl.models.hf import is_plausible_hub_id

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tandemrl.configs.data import DatasetConfig

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


# ----------------------------------------------------------------------------- registry

DatasetFn = Callable[..., "Dataset"]


@dataclass(frozen=True)
class DatasetHandlers:
    """Builders of one named dataset; each is fn(path, split, tokenizer, rank, world_size, **kw)."""

    sft: DatasetFn | None = None
    rl: DatasetFn | None = None


_REGISTRY: dict[str, DatasetHandlers] = {}


def register_dataset(name: str, sft_fn: DatasetFn | None = None, rl_fn: DatasetFn | None = None) -> None:
    """Make `get_custom_dataset` use these builders for paths with a component equal to `name`.

    E.g. name "gsm8k" matches "openai/gsm8k" and "/data/gsm8k". Re-registering replaces.
    """
    if not name or "/" in name:
        raise ValueError(f"dataset name {name!r} must be a non-empty path component (no '/')")
    if sft_fn is None and rl_fn is None:
        raise ValueError(f"register_dataset({name!r}): give at least one of sft_fn, rl_fn")
    _REGISTRY[name.lower()] = DatasetHandlers(sft=sft_fn, rl=rl_fn)


def registered_datasets() -> list[str]:
    return sorted(_REGISTRY)


def _registered(path: str) -> tuple[str, DatasetHandlers] | None:
    """The deepest path component that is a registered name, and its handlers."""
    parts = [p.lower() for p in os.path.normpath(os.path.expanduser(path)).split(os.sep) if p]
    for part in reversed(parts):
        if part in _REGISTRY:
            return part, _REGISTRY[part]
    return None


def resolve_dataset_fn(path: str, type: str) -> DatasetFn:
    """The builder for `path`: the deepest path component that is a registered name, else GSM8K's."""
    if type not in DATASET_TYPES:
        raise ValueError(f"dataset type {type!r} is not one of {', '.join(DATASET_TYPES)}")
    found = _registered(path)
    if found is not None:
        name, handlers = found
        fn = getattr(handlers, type)
        if fn is None:
            raise ValueError(f"dataset {name!r} (path {path}) has no {type!r} builder registered")
        return fn
    from tandemrl.data import gsm8k

    return gsm8k.get_gsm8k_sft_dataset if type == "sft" else gsm8k.get_gsm8k_rl_dataset


def get_custom_dataset(
    path: str,
    type: str,
    split: str,
    tokenizer: Any,
    rank: int,
    world_size: int,
    max_length: int | None = None,
    max_samples: int | None = None,
    **kwargs: Any,
) -> Dataset:
    """This rank's shard of a dataset, built by the handler registered for `path`."""
    fn = resolve_dataset_fn(path, type)
    return fn(path, split, tokenizer, rank, world_size, max_length=max_length, max_samples=max_samples, **kwargs)


def _accepted(fn: DatasetFn, options: dict[str, Any]) -> dict[str, Any]:
    """The options a builder takes (all of them if it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return options
    names = {p.name for p in params}
    return {k: v for k, v in options.items() if k in names}


def dataset_from_config(
    config: DatasetConfig, tokenizer: Any, rank: int, world_size: int, context_length: int | None = None
) -> Dataset:
    """`get_custom_dataset` with every option taken from a DatasetConfig.

    ``context_length`` is the model's context (``max_position_embeddings``); samples over it are
    handled like those over ``max_length``. None falls back to the tokenizer's ``model_max_length``.
    Builders that do not take ``on_too_long``/``context_length`` are called without them.
    """
    fn = resolve_dataset_fn(config.path, config.type)
    context = context_length if context_length is not None else tokenizer_context(tokenizer)
    options = _accepted(fn, {"on_too_long": config.on_too_long, "context_length": context})
    if config.on_too_long != "drop" and "on_too_long" not in options:
        raise ValueError(
            f"on_too_long={config.on_too_long!r} (dataset {config.path}): its builder {fn.__name__} "
            "takes no on_too_long argument"
        )
    return get_custom_dataset(
        config.path,
        config.type,
        config.split,
        tokenizer,
        rank,
        world_size,
        max_length=config.max_length,
        max_samples=config.max_samples,
        **options,
    )


def check_dataset_inputs(config: DatasetConfig) -> None:
    """What can be checked before any process starts: the directory and split file exist and, for
    GSM8K-format data (a path no registered builder claims), every row parses and has its fields.

    Registered datasets may build their files on first use, so they are left to their builders.
    """
    if _registered(config.path) is not None:
        return
    file = _local_split_file(config.path, config.split)
    if file is not None:
        from tandemrl.data.gsm8k import REQUIRED_FIELDS

        scan_jsonl(file, REQUIRED_FIELDS, max_rows=config.max_samples)


# ----------------------------------------------------------------------------- dataloader


def collate_as_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep samples as a list of dicts; workflows and trainers decide how to tensorize."""
    return batch


def create_dataloader(
    dataset: Any,
    config: DatasetConfig,
    rank: int,
    world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    seed: int = 1,
) -> StatefulDataLoader:
    """A resumable dataloader over this rank's shard; per-rank batch = global batch / world size.

    Restored from its ``state_dict`` it yields exactly the batches an uninterrupted one would,
    epoch ends and the reshuffles of later epochs included.
    """
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank={rank} for world_size={world_size}")
    if config.batch_size <= 0 or config.batch_size % world_size:
        raise ValueError(
            f"DatasetConfig.batch_size={config.batch_size} must be a positive multiple of world_size={world_size}"
        )
    batch_size = config.batch_size // world_size
    if config.drop_last and len(dataset) < batch_size:
        raise ValueError(
            f"rank {rank} has {len(dataset)} samples, fewer than its batch size {batch_size} "
            f"(DatasetConfig.batch_size={config.batch_size} over {world_size} ranks) with drop_last=True"
        )
    # The shuffle has its own generator. The loader draws a worker base seed from its ``generator``
    # every epoch, after the permutation; a restored sampler replays only the permutation, so one
    # shared generator would shuffle every epoch after a restore differently from an uninterrupted run.
    sampler = None
    if config.shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=config.drop_last,
        num_workers=config.num_workers,
        collate_fn=collate_fn or collate_as_list,
        generator=torch.Generator().manual_seed(seed),
    )


def _as_tensor(value: Any, idx: int, key: str) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"sample {idx}: field {key!r} ({type(value).__name__}) cannot be turned into a tensor"
        ) from None
    if t.dim() > 1:
        raise ValueError(f"sample {idx}: field {key!r} must be a scalar or a 1-D sequence, got shape {tuple(t.shape)}")
    return t


def pad_sequences_to_tensors(samples: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad per-token fields into [B, L] tensors and add a bool `attention_mask`.

    Per-token fields (same length as the sample's input_ids) are padded with 0
    (`pad_token_id` for input_ids); scalar fields become [B] tensors. Any given
    attention_mask is replaced by the one derived from the lengths.
    """
    import torch

    if not samples:
        raise ValueError("cannot pad an empty list of samples")
    keys = [k for k in samples[0] if k != "attention_mask"]
    if "input_ids" not in keys:
        raise ValueError("sample 0: required field 'input_ids' is missing")
    per_sample: list[dict[str, torch.Tensor]] = []
    lengths: list[int] = []
    for i, s in enumerate(samples):
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValueError(f"sample {i}: field {missing[0]!r} is missing (present in sample 0)")
        ts = {k: _as_tensor(s[k], i, k) for k in keys}
        n = ts["input_ids"].numel()
        if ts["input_ids"].dim() != 1 or n == 0:
            raise ValueError(f"sample {i}: 'input_ids' must be a non-empty 1-D sequence")
        for k, t in ts.items():
            if t.dim() == 1 and t.numel() != n:
                raise ValueError(f"sample {i}: field {k!r} has length {t.numel()} but input_ids has {n}")
        per_sample.append(ts)
        lengths.append(n)

    bsz, max_len = len(samples), max(lengths)
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ts = [p[k] for p in per_sample]
        dims = {t.dim() for t in ts}
        if len(dims) != 1:
            raise ValueError(f"field {k!r} is a scalar in some samples and a sequence in others")
        dtype = ts[0].dtype
        for t in ts[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        if dims == {0}:
            out[k] = torch.stack([t.to(dtype) for t in ts])
            continue
        fill = pad_token_id if k == "input_ids" else 0
        padded = torch.full((bsz, max_len), fill, dtype=dtype)
        for i, t in enumerate(ts):
            padded[i, : t.numel()] = t.to(dtype)
        out[k] = padded
    lens = torch.tensor(lengths)
    out["attention_mask"] = torch.arange(max_len)[None, :] < lens[:, None]
    return out
