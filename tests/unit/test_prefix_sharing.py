"""Group-shared prefix layout: segments and layout on hand values, exact logits and gradients on the tiny model.

The 2-rank FSDP2 and DeepSpeed checks of a whole GRPO update are in test_fsdp_engine.py and
test_deepspeed_engine.py (tests/workers/prefix_checks.py).
"""

from __future__ import annotations

import pytest
import torch

from tandemrl.engines.packing import pack_groups
from tandemrl.engines.prefix_sharing import (
    Segment,
    add_shared_layout,
    build_shared_layout,
    prefix_segments,
    segment_fields,
    sharing_segments,
    unshare,
)

ROWS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7, 8], [1, 9, 9], [1, 9, 9, 5]]


def _padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    am = torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
    return {"input_ids": ids, "attention_mask": am}


def test_segments_join_rows_while_sharing_saves_tokens() -> None:
    b = _padded(ROWS)
    lens = [len(r) for r in ROWS]
    # Row 3 shares only token 1 with rows 0-2: joining would cost more than the 3-token prefix saves.
    assert prefix_segments(b["input_ids"], lens) == [Segment(0, 3, 3, 9), Segment(3, 5, 3, 4)]
    # A token budget stops a segment from growing past it; a lone row shares nothing.
    assert prefix_segments(b["input_ids"], lens, max_tokens=8) == [
        Segment(0, 2, 3, 6),
        Segment(2, 4, 1, 8),
        Segment(4, 5, 0, 4),
    ]
    # auto shares only when it saves >= 10% of the tokens: 13 of 22 here, 22 of 22 for unrelated rows.
    assert sharing_segments(b, "auto") is not None
    assert sharing_segments(_padded([[1, 2], [3, 4], [5, 6]]), "auto") is None
    assert sharing_segments(_padded([[1, 2], [3, 4]]), "on") == [Segment(0, 1, 0, 2), Segment(1, 2, 0, 2)]


def test_shared_layout_on_hand_values() -> None:
    b = _padded(ROWS)
    b.update(segment_fields(prefix_segments(b["input_ids"], [len(r) for r in ROWS])))
    mb = pack_groups(b, [list(range(len(ROWS)))]).mbs[0]
    lay = build_shared_layout(mb["input_ids"], mb["cu_seqlens"], mb["prefix_segment"], mb["prefix_len"])
    assert lay.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 4, 7, 8, 1, 9, 9, 5]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2, 3]
    assert lay.block_cu.tolist() == [0, 3, 5, 6, 9, 12, 13]
    assert lay.block_prefix.tolist() == [-1, 0, 0, 0, -1, 4]  # row 3 equals its prefix: no block of its own
    assert lay.index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11, 9, 10, 11, 12]
    assert torch.equal(unshare(lay.input_ids, lay.index), mb["input_ids"])
    # A prefix the tokens do not have is refused, naming the row.
    bad = {**mb, "prefix_len": torch.tensor([3, 3, 4, 3, 3])}
    with pytest.raises(ValueError, match="sequence 2 does not start with its segment's 4-token prefix"):
        add_shared_layout(bad)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_logits_and_gradients_equal_the_unshared_ones(tiny_model_dir: str, checkpointing: bool) -> None:
    """fp32, tiny Qwen2 (GQA): 3 groups of 4 with completions of different lengths, one equal to another."""
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.hf_model import build_hf_model, packed_logits

    cfg = TrainEngineConfig(path=tiny_model_dir, mixed_precision=None, gradient_checkpointing=checkpointing)
    model, _ = build_hf_model(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    rows = []
    for p in (7, 12, 9):
        prompt = torch.randint(3, 500, (p,), generator=g).tolist()
        outs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 1, 6, 3)]
        outs[3] = outs[0][:3]
        rows += [prompt + o for o in outs]
    b = _padded(rows)
    segs = sharing_segments(b, "on")
    assert [s.prefix_len for s in segs] == [7, 12, 9]
    mb = pack_groups({**b, **segment_fields(segs)}, [list(range(len(rows)))]).mbs[0]
    shared = add_shared_layout(mb)
    assert len(shared["shared_input_ids"]) == 28 + 42  # prompts once + completions
    grads = []
    for m in (mb, shared):
        model.zero_grad()
        logits = packed_logits(model, m, cfg.attn_impl)
        logits.float().pow(2).mean().backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref, ref_g), (got, got_g) = grads
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(ref_g, got_g, strict=True)) < 1e-5


def test_unsupported_settings_fail_with_the_field_name(tiny_model_dir: str) -> None:
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.fsdp import FSDPEngine

    batch = _padded(ROWS)
    for cfg, match in (
        (TrainEngineConfig(prefix_sharing="always"), "prefix_sharing: 'always' is not one of auto, on, off"),
        (TrainEngineConfig(prefix_sharing="on", attn_impl="sdpa"), "prefix_sharing: 'on' needs attn_impl=varlen_sdpa"),
    ):
        with pytest.raises(ValueError, match=match):
            FSDPEngine(cfg)._prefix_segments(batch)
    # auto with another attention implementation just runs unshared.
    assert FSDPEngine(TrainEngineConfig(attn_impl="sdpa"))._prefix_segments(batch) is None
    from tandemrl.engines.megatron.engine import MegatronEngine

    assert MegatronEngine(TrainEngineConfig())._prefix_segments(batch) is None  # auto: off on Megatron
    with pytest.raises(ValueError, match="prefix_sharing: the megatron engine does not support 'on'"):
        MegatronEngine(TrainEngineConfig(prefix_sharing="on"))._prefix_segments(batch)
