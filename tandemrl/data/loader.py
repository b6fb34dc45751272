"""A registry of dataset builders, dataloaders and batch padding.

Heavy libraries (datasets, torch, torchdata) are imported inside the functions so that
`import tandemrl.data` stays cheap. Reading split files lives in ``tandemrl.data.rows``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandemrl.data import gsm8k
from tandemrl.data.reasoning_gym import ensure_written
from tandemrl.data.rows import DATASET_TYPES, _local_split_file, scan_jsonl, tokenizer_context

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tandemrl.configs.data import DatasetConfig


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
    ensure_written(config, "dataset")  # reasoning-gym rows, if the config generates them and no one has yet
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


def check_dataset_inputs(config: DatasetConfig) -> int | None:
    """What can be checked before any process starts: the directory and split file exist and, for
    GSM8K-format data (a path no registered builder claims), every row parses and has its fields.

    Returns the rows the run reads (at most ``max_samples``), None where unknown without building
    the dataset: registered datasets may build their files on first use, so they are left to their
    builders, and hub ids are not downloaded here.
    """
    if _registered(config.path) is not None:
        return None
    file = _local_split_file(config.path, config.split)
    if file is None:
        return None
    return scan_jsonl(file, gsm8k.REQUIRED_FIELDS, max_rows=config.max_samples)


# ----------------------------------------------------------------------------- dataloader


def collate_as_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep samples as a list of dicts; workflows and trainers decide how to tensorize."""
    return batch


def cycle_batches(dataloader: Iterable[Any], what: str = "prepare_batch") -> Iterator[Any]:
    """Endless batches; re-iterating the dataloader each epoch (so it reshuffles).

    One empty pass is allowed: a stateful dataloader restored at the end of an epoch yields
    nothing until its next pass.
    """
    empty_passes = 0
    while empty_passes < 2:
        empty_passes += 1
        for batch in dataloader:
            empty_passes = 0
            yield batch
    raise ValueError(f"{what}: the dataloader yielded no batches")


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
        column = [p[k] for p in per_sample]
        dims = {t.dim() for t in column}
        if len(dims) != 1:
            raise ValueError(f"field {k!r} is a scalar in some samples and a sequence in others")
        dtype = column[0].dtype
        for t in column[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        if dims == {0}:
            out[k] = torch.stack([t.to(dtype) for t in column])
            continue
        fill = pad_token_id if k == "input_ids" else 0
        padded = torch.full((bsz, max_len), fill, dtype=dtype)
        for i, t in enumerate(column):
            padded[i, : t.numel()] = t.to(dtype)
        out[k] = padded
    lens = torch.tensor(lengths)
    out["attention_mask"] = torch.arange(max_len)[None, :] < lens[:, None]
    return out
