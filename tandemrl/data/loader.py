"""Loading dataset splits, a registry of dataset builders, dataloaders and batch padding.

Heavy libraries (datasets, torch, torchdata) are imported inside the functions so that
`import tandemrl.data` stays cheap.
"""

from __future__ import annotations

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


def _first_bad_json_line(file: str) -> str | None:
    """Point at the first unparsable line; arrow's own error names neither file nor line."""
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{file}: line {lineno}: invalid JSON ({e.msg})"
            if not isinstance(row, dict):
                return f"{file}: line {lineno}: expected a JSON object, got {type(row).__name__}"
    return None


def load_split(path: str, split: str, max_samples: int | None = None, *, name: str | None = "main") -> Dataset:
    """One split of a dataset: `{path}/{split}.jsonl` for a local directory, else a hub dataset.

    `name` is the hub config (GSM8K's is "main"). `max_samples` keeps the first N rows.
    """
    from datasets import load_dataset

    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples={max_samples} must be positive (or None for all rows)")
    if os.path.isdir(os.path.expanduser(path)):
        file = split_file(path, split)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"dataset split file not found: {file} (split {split!r} of {path})")
        try:
            ds = load_dataset("json", data_files=file, split="train")
        except Exception as e:  # arrow/datasets errors do not say which line is broken
            detail = _first_bad_json_line(file)
            if detail is None:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                detail = f"{file}: could not be loaded as JSON lines ({type(e).__name__}: {first})"
            raise ValueError(detail) from e
    elif _looks_local(path):
        raise FileNotFoundError(f"dataset directory not found: {path}")
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
            v = None if col is None else col[idx]
            if v is None:
                raise ValueError(f"{source}: row {idx}: required field {field!r} is missing")
            if not isinstance(v, str):
                raise ValueError(f"{source}: row {idx}: field {field!r} must be a string, got {type(v).__name__}")
            if not v.strip():
                raise ValueError(f"{source}: row {idx}: field {field!r} is empty")


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


def resolve_dataset_fn(path: str, type: str) -> DatasetFn:
    """The builder for `path`: the deepest path component that is a registered name, else GSM8K's."""
    if type not in DATASET_TYPES:
        raise ValueError(f"dataset type {type!r} is not one of {', '.join(DATASET_TYPES)}")
    parts = [p.lower() for p in os.path.normpath(os.path.expanduser(path)).split(os.sep) if p]
    for part in reversed(parts):
        handlers = _REGISTRY.get(part)
        if handlers is not None:
            fn = getattr(handlers, type)
            if fn is None:
                raise ValueError(f"dataset {part!r} (path {path}) has no {type!r} builder registered")
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


def dataset_from_config(config: DatasetConfig, tokenizer: Any, rank: int, world_size: int) -> Dataset:
    """`get_custom_dataset` with every option taken from a DatasetConfig."""
    return get_custom_dataset(
        config.path,
        config.type,
        config.split,
        tokenizer,
        rank,
        world_size,
        max_length=config.max_length,
        max_samples=config.max_samples,
    )


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
    """A resumable dataloader over this rank's shard; per-rank batch = global batch / world size."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

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
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=config.shuffle,
        drop_last=config.drop_last,
        num_workers=config.num_workers,
        collate_fn=collate_fn or collate_as_list,
        generator=generator,
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
