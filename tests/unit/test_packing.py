"""Padded <-> packed conversion and micro-batch planning."""

from __future__ import annotations

import pytest
import torch

from tandemrl.engines.packing import plan_micro_batches, split_padded_batch, unpack_to_padded
from tandemrl.models.functional import next_token_labels, next_token_mask


def _batch() -> dict[str, torch.Tensor]:
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    ids = torch.arange(20).view(4, 5) * am
    return {"input_ids": ids, "attention_mask": am, "rewards": torch.tensor([0.1, 0.2, 0.3, 0.4])}


def test_pack_and_unpack_round_trip() -> None:
    b = _batch()
    mbs = split_padded_batch(b, n_mbs=2)
    assert len(mbs.mbs) == 2
    assert sorted(i for g in mbs.groups for i in g) == [0, 1, 2, 3]
    for mb, g in zip(mbs.mbs, mbs.groups, strict=True):
        lens = b["attention_mask"][g].sum(1)
        assert mb["cu_seqlens"].tolist() == [0, *torch.cumsum(lens, 0).tolist()]
        assert mb["rewards"].tolist() == pytest.approx(b["rewards"][g].tolist())
        # position ids restart for every sequence
        assert mb["position_ids"].tolist() == [p for n in lens.tolist() for p in range(n)]
    back = unpack_to_padded([mb["input_ids"] for mb in mbs.mbs], mbs, b["attention_mask"])
    assert torch.equal(back, b["input_ids"])


def test_token_budget_and_balance() -> None:
    lens = [10, 9, 8, 3, 2, 1]
    groups = plan_micro_batches(lens, n_mbs=1, max_tokens_per_mb=12)
    sums = [sum(lens[i] for i in g) for g in groups]
    assert max(sums) <= 12 and sum(sums) == 33 and len(groups) == 3
    # a sequence longer than the budget still gets a micro-batch of its own
    assert plan_micro_batches([30, 2], 1, 10) == [[0], [1]]


def test_granularity_keeps_groups_together() -> None:
    b = _batch()
    mbs = split_padded_batch(b, n_mbs=2, granularity=2)
    assert sorted(sorted(g) for g in mbs.groups) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="granularity 3"):
        split_padded_batch(b, granularity=3)


def test_next_token_labels_stay_inside_sequences() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9])
    cu = torch.tensor([0, 3, 5])
    assert next_token_labels(ids, cu).tolist() == [6, 7, 7, 9, 9]
    assert next_token_mask(torch.tensor([0, 1, 1, 1, 1]), cu).tolist() == [True, True, False, True, False]
