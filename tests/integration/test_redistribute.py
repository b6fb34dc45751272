"""Rollout batches are redistributed over DP ranks without splitting a prompt's group."""

from __future__ import annotations

from pathlib import Path

import torch
from utils import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "redistribute_check.py"


def test_groups_stay_whole_and_nothing_is_lost(tmp_path: Path) -> None:
    out = tmp_path / "parts.pt"
    run_torchrun(WORKER, 2, [out], env={"TANDEMRL_DIST_TIMEOUT": "120"})
    parts = torch.load(out)
    ids = []
    for part in parts:
        r = part["rewards"].tolist()
        assert len(r) % 2 == 0 and all(r[i] == r[i + 1] for i in range(0, len(r), 2)), r  # groups whole
        # rows keep their own tokens and lengths after re-padding
        for row, mask, ident in zip(part["input_ids"], part["attention_mask"], r, strict=True):
            assert set(row[mask].tolist()) == {int(ident)}
        ids += r
    assert sorted(ids) == sorted([100.0 * k + g for k in range(2) for g in range(3) for _ in range(2)])
    assert all(len(p["rewards"]) > 0 for p in parts)
    # balanced by tokens: neither rank gets everything
    tokens = [int(p["attention_mask"].sum()) for p in parts]
    assert max(tokens) < sum(tokens)
