"""GSM8K loading, SFT/RL sample building, sharding, validation errors, dataloaders and padding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandemrl.configs.data import DatasetConfig
from tandemrl.data import (
    create_dataloader,
    dataset_from_config,
    get_custom_dataset,
    get_gsm8k_rl_dataset,
    get_gsm8k_sft_dataset,
    load_split,
    pad_sequences_to_tensors,
    register_dataset,
)
from tandemrl.data import loader as loader_mod
from tandemrl.models import load_hf_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir: str) -> Any:
    return load_hf_tokenizer(tiny_model_dir)


def _rows(gsm8k_dir: str, split: str, n: int) -> list[dict[str, str]]:
    with open(Path(gsm8k_dir) / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def _write_jsonl(path: Path, rows: list[Any]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_sft_loss_mask_covers_exactly_the_answer(gsm8k_dir: str, tok: Any) -> None:
    ds = get_gsm8k_sft_dataset(gsm8k_dir, "test", tok, rank=0, world_size=1, max_samples=12)
    rows = _rows(gsm8k_dir, "test", 12)
    assert len(ds) == 12 and set(ds.column_names) == {"input_ids", "loss_mask"}
    for sample, row in zip(ds, rows, strict=True):
        ids, mask = sample["input_ids"], sample["loss_mask"]
        assert len(ids) == len(mask)
        start = mask.index(1)
        assert all(m == 0 for m in mask[:start]) and all(m == 1 for m in mask[start:])  # prompt then answer
        msgs = [{"role": "user", "content": row["question"]}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.decode(ids[:start]) == prompt
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[start:-1]) == row["answer"]


def test_sft_max_length_drops_long_samples(gsm8k_dir: str, tok: Any) -> None:
    full = get_gsm8k_sft_dataset(gsm8k_dir, "test", tok, 0, 1, max_samples=40)
    lengths = sorted(len(x) for x in full["input_ids"])
    limit = lengths[len(lengths) // 2]
    short = get_gsm8k_sft_dataset(gsm8k_dir, "test", tok, 0, 1, max_length=limit, max_samples=40)
    assert len(short) == sum(n <= limit for n in lengths) < len(full)
    assert max(len(x) for x in short["input_ids"]) <= limit
    with pytest.raises(ValueError, match="no sample fits max_length=5"):
        get_gsm8k_sft_dataset(gsm8k_dir, "test", tok, 0, 1, max_length=5, max_samples=10)


def test_two_ranks_get_disjoint_equal_halves(gsm8k_dir: str, tok: Any) -> None:
    full = get_gsm8k_sft_dataset(gsm8k_dir, "train", tok, 0, 1, max_samples=21)
    r0 = get_gsm8k_sft_dataset(gsm8k_dir, "train", tok, 0, 2, max_samples=21)
    r1 = get_gsm8k_sft_dataset(gsm8k_dir, "train", tok, 1, 2, max_samples=21)
    a = [tuple(x) for x in r0["input_ids"]]
    b = [tuple(x) for x in r1["input_ids"]]
    assert len(a) == len(b) == 10  # 21 rows trimmed to 20 so both ranks see as many batches
    assert not set(a) & set(b)
    assert a + b == [tuple(x) for x in full["input_ids"]][:20]
    with pytest.raises(ValueError, match="invalid rank=2 for world_size=2"):
        get_gsm8k_sft_dataset(gsm8k_dir, "train", tok, 2, 2, max_samples=4)


def test_rl_dataset_rows_and_prompt_length_filter(gsm8k_dir: str, tok: Any) -> None:
    rows = _rows(gsm8k_dir, "test", 30)
    ds = get_gsm8k_rl_dataset(gsm8k_dir, "test", tok, 0, 1, max_samples=30)
    assert len(ds) == 30 and set(ds.column_names) == {"id", "messages", "question", "answer"}
    assert ds[3]["messages"] == [{"role": "user", "content": rows[3]["question"]}]
    assert ds[3]["answer"] == rows[3]["answer"] and ds[3]["question"] == rows[3]["question"]

    def prompt_len(q: str) -> int:
        msgs = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lens = [prompt_len(r["question"]) for r in rows]
    limit = sorted(lens)[15]
    short = get_gsm8k_rl_dataset(gsm8k_dir, "test", tok, 0, 1, max_length=limit, max_samples=30)
    assert short["question"] == [r["question"] for r, n in zip(rows, lens, strict=True) if n <= limit]
    assert short["id"] == [i for i, n in enumerate(lens) if n <= limit]  # the split's row, kept through the filter


@pytest.mark.parametrize(
    ("bad_row", "match"),
    [
        ({"question": "How many?"}, "row 2: required field 'answer' is missing"),
        ({"question": "How many?", "answer": 7}, "row 2: field 'answer' must be a string, got int"),
        ({"question": "  ", "answer": "#### 1"}, "row 2: field 'question' is empty"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path: Path, tok: Any, bad_row: dict[str, Any], match: str) -> None:
    good = {"question": "What is 1+1?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}
    _write_jsonl(tmp_path / "train.jsonl", [good, good, bad_row, good])
    for build in (get_gsm8k_sft_dataset, get_gsm8k_rl_dataset):
        with pytest.raises(ValueError, match=match) as err:
            build(str(tmp_path), "train", tok, 0, 1)
        msg = str(err.value)
        assert str(tmp_path / "train.jsonl") in msg and "\n" not in msg


def test_invalid_json_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"question": "a", "answer": "b"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"train\.jsonl: line 2: invalid JSON"):
        load_split(str(tmp_path), "train")


def test_missing_split_file_or_dir_is_named(tmp_path: Path, tok: Any) -> None:
    _write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl") as err:
        get_gsm8k_sft_dataset(str(tmp_path), "test", tok, 0, 1)
    assert str(tmp_path / "test.jsonl") in str(err.value)
    with pytest.raises(FileNotFoundError, match="dataset directory not found"):
        load_split(str(tmp_path / "absent"), "train")


def test_dataloader_batch_sizes_per_rank(gsm8k_dir: str, tok: Any) -> None:
    ds = get_gsm8k_rl_dataset(gsm8k_dir, "test", tok, 1, 2, max_samples=22)  # 11 per rank
    cfg = DatasetConfig(path=gsm8k_dir, type="rl", batch_size=8, shuffle=True, drop_last=True)
    dl = create_dataloader(ds, cfg, rank=1, world_size=2)
    batches = list(dl)
    assert len(dl) == len(batches) == 2 and all(len(b) == 4 for b in batches)
    assert isinstance(batches[0][0], dict) and "messages" in batches[0][0]
    seen = [s["question"] for b in batches for s in b]
    assert len(set(seen)) == 8 and set(seen) <= set(ds["question"])

    keep = DatasetConfig(path=gsm8k_dir, batch_size=8, shuffle=False, drop_last=False)
    sizes = [len(b) for b in create_dataloader(ds, keep, rank=1, world_size=2)]
    assert sizes == [4, 4, 3]
    with pytest.raises(ValueError, match="batch_size=6 must be a positive multiple of world_size=4"):
        create_dataloader(ds, DatasetConfig(batch_size=6), rank=0, world_size=4)
    with pytest.raises(ValueError, match="fewer than its batch size 16"):
        create_dataloader(ds, DatasetConfig(batch_size=32), rank=0, world_size=2)


def test_dataloader_resumes_from_state_dict(gsm8k_dir: str, tok: Any) -> None:
    ds = get_gsm8k_rl_dataset(gsm8k_dir, "test", tok, 0, 1, max_samples=40)
    cfg = DatasetConfig(batch_size=4, shuffle=True, drop_last=True)
    dl = create_dataloader(ds, cfg, 0, 1, seed=5)
    it = iter(dl)
    first = [next(it) for _ in range(3)]
    state = dl.state_dict()
    expected = next(it)
    resumed = create_dataloader(ds, cfg, 0, 1, seed=5)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert [s["question"] for s in got] == [s["question"] for s in expected]
    assert [s["question"] for s in got] not in [[s["question"] for s in b] for b in first]
    fresh_first = next(iter(create_dataloader(ds, cfg, 0, 1, seed=5)))
    assert [s["question"] for s in fresh_first] == [s["question"] for s in first[0]]  # seeded order


def test_pad_sequences_to_tensors() -> None:
    samples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "reward": 1.5},
        {"input_ids": [8], "loss_mask": [1], "reward": -1.0},
    ]
    out = pad_sequences_to_tensors(samples, pad_token_id=9)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]] and out["input_ids"].dtype == torch.long
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out["attention_mask"].dtype == torch.bool
    assert out["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert out["reward"].tolist() == [1.5, -1.0] and out["reward"].dtype == torch.float32
    with pytest.raises(ValueError, match="sample 1: field 'loss_mask' has length 2 but input_ids has 1"):
        pad_sequences_to_tensors([samples[0], {"input_ids": [1], "loss_mask": [1, 1], "reward": 0.0}])
    with pytest.raises(ValueError, match="sample 0: field 'question'"):
        pad_sequences_to_tensors([{"input_ids": [1], "question": "why"}])
    with pytest.raises(ValueError, match="sample 1: field 'reward' is missing"):
        pad_sequences_to_tensors([samples[0], {"input_ids": [1], "loss_mask": [1]}])
    with pytest.raises(ValueError, match="empty list"):
        pad_sequences_to_tensors([])


def test_sft_batches_pad_into_engine_format(gsm8k_dir: str, tok: Any) -> None:
    cfg = DatasetConfig(path=gsm8k_dir, type="sft", split="test", batch_size=4, max_length=256, max_samples=16)
    ds = dataset_from_config(cfg, tok, rank=0, world_size=1)
    dl = create_dataloader(ds, cfg, 0, 1, collate_fn=lambda b: pad_sequences_to_tensors(b, tok.pad_token_id))
    batch = next(iter(dl))
    lens = batch["attention_mask"].sum(1)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] == int(lens.max()) <= 256
    assert (batch["loss_mask"].bool() & ~batch["attention_mask"]).sum() == 0  # no loss on padding
    ends = batch["input_ids"][torch.arange(4), lens - 1]
    assert (ends == tok.eos_token_id).all()


def test_registry_dispatches_by_path_component(
    monkeypatch: pytest.MonkeyPatch, gsm8k_dir: str, tok: Any, tmp_path: Path
) -> None:
    monkeypatch.setattr(loader_mod, "_REGISTRY", {})
    calls: list[tuple[Any, ...]] = []

    def toy_sft(path: str, split: str, tokenizer: Any, rank: int, world_size: int, **kw: Any) -> list[str]:
        calls.append((path, split, rank, world_size, kw["max_length"], kw["max_samples"]))
        return ["toy"]

    register_dataset("toy-math", sft_fn=toy_sft)
    toy_dir = str(tmp_path / "toy-math")
    assert get_custom_dataset(toy_dir, "sft", "train", tok, 1, 2, max_length=64, max_samples=3) == ["toy"]
    assert calls == [(toy_dir, "train", 1, 2, 64, 3)]
    with pytest.raises(ValueError, match="dataset 'toy-math' .* has no 'rl' builder"):
        get_custom_dataset("org/toy-math", "rl", "train", tok, 0, 1)
    with pytest.raises(ValueError, match="dataset type 'dpo' is not one of sft, rl"):
        get_custom_dataset(gsm8k_dir, "dpo", "train", tok, 0, 1)
    # Unregistered names fall back to the GSM8K builders.
    ds = get_custom_dataset(gsm8k_dir, "rl", "test", tok, 0, 1, max_samples=4)
    assert len(ds) == 4 and "messages" in ds.column_names
    with pytest.raises(ValueError, match="at least one of sft_fn, rl_fn"):
        register_dataset("empty")


@pytest.mark.parametrize("shuffle", [True, False])
def test_restored_dataloader_matches_an_uninterrupted_one_at_every_position(shuffle: bool) -> None:
    from tandemrl.data.loader import cycle_batches

    cfg = DatasetConfig(batch_size=4, shuffle=shuffle, drop_last=True)
    items = list(range(10))  # 2 full batches an epoch, 2 items dropped
    n_batches = 7  # three and a half epochs
    reference = cycle_batches(create_dataloader(items, cfg, 0, 1, seed=3))
    expected = [next(reference) for _ in range(n_batches)]
    assert len({tuple(b) for b in expected}) > (2 if shuffle else 1)  # later epochs really reshuffle
    for saved_after in range(n_batches):  # epoch ends included (after batches 2, 4, 6)
        dl = create_dataloader(items, cfg, 0, 1, seed=3)
        batches = cycle_batches(dl)
        head = [next(batches) for _ in range(saved_after)]
        restored = create_dataloader(items, cfg, 0, 1, seed=3)
        restored.load_state_dict(dl.state_dict())
        rest = cycle_batches(restored)
        assert head + [next(rest) for _ in range(n_batches - saved_after)] == expected, saved_after
    # Saved after a finished pass (the loader's iterator ran to its end): the next epoch still matches.
    dl = create_dataloader(items, cfg, 0, 1, seed=3)
    assert list(dl) == expected[:2]
    restored = create_dataloader(items, cfg, 0, 1, seed=3)
    restored.load_state_dict(dl.state_dict())
    assert list(restored) == expected[2:4] == list(dl)
