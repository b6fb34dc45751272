"""The bucket wire format's packing options and reused receive buffers (tandemrl.weights.wire).

The receive side runs over a real 2-rank gloo weight-update group (two threads of this process).
"""

from __future__ import annotations

import threading

import pytest
import torch
from utils import free_port

from tandemrl.api.inference import ParamSpec
from tandemrl.weights.group import destroy_group, host_group, join_group
from tandemrl.weights.wire import bucket_layout, pack_bucket, receive_buckets


def test_pack_casts_floats_only_in_one_pass() -> None:
    # fp32 1.5 = 0x3FC00000 and -2.0 = 0xC0000000: bf16 keeps the high halves, 0x3FC0 and 0xC000.
    tensors = [("w", torch.tensor([1.5, -2.0])), ("step", torch.tensor([7], dtype=torch.int64))]
    flat, specs = pack_bucket(tensors, dtype=torch.bfloat16)
    assert specs == [ParamSpec("w", (2,), "bfloat16"), ParamSpec("step", (1,), "int64")]
    (w_at, w_n), (s_at, s_n) = bucket_layout(specs)
    assert (w_at, w_n, s_at, s_n) == (0, 4, 64, 8) and flat.numel() == 128
    assert flat[w_at : w_at + w_n].tolist() == [0xC0, 0x3F, 0x00, 0xC0]  # little-endian bf16 words
    assert flat[s_at : s_at + s_n].view(torch.int64).tolist() == [7]
    assert int(flat[w_n:s_at].sum()) == 0 and int(flat[s_at + s_n :].sum()) == 0  # padding zeroed


def test_pack_into_given_buffer_and_refuses_wrong_size() -> None:
    out = torch.full((64,), 0xAB, dtype=torch.uint8)  # stale bytes from an earlier update
    flat, _ = pack_bucket([("w", torch.tensor([1.0, 2.0]))], out=out)
    assert flat.data_ptr() == out.data_ptr()
    assert out[:8].view(torch.float32).tolist() == [1.0, 2.0] and int(out[8:].sum()) == 0
    with pytest.raises(ValueError, match="out must be a 1-D uint8 tensor of 64 bytes"):
        pack_bucket([("w", torch.tensor([1.0]))], out=torch.empty(128, dtype=torch.uint8))


def test_receive_reuses_each_buckets_buffer_across_updates() -> None:
    """Two updates of the same plan land in the same two buffers (one per bucket); a plan whose second bucket
    changes size gets a new buffer for it alone; every tensor arrives with the sender's values."""
    plan_a = [[ParamSpec("a", (3,), "float32")], [ParamSpec("b", (20,), "float32")]]
    plan_b = [plan_a[0], [ParamSpec("b", (40,), "float32")]]
    updates = [plan_a, plan_a, plan_b]
    port, buffers, got, ptrs = free_port(), [], [], []

    def receive() -> None:
        pg = join_group("127.0.0.1", port, 2, 1, "gloo", timeout_s=60)
        try:
            for plan in updates:
                got.append([(n, t.clone()) for n, t in receive_buckets(pg, plan, "cpu", buffers)])
                ptrs.append([(b.data_ptr(), b.numel()) for b in buffers])
        finally:
            destroy_group(pg)

    th = threading.Thread(target=receive)
    th.start()
    pg = host_group("127.0.0.1", port, 2, "gloo", timeout_s=60)
    try:
        for u, plan in enumerate(updates):
            for specs in plan:
                tensors = [(s.name, torch.arange(s.shape[0], dtype=torch.float32) + 100 * u) for s in specs]
                pg.broadcast(pack_bucket(tensors)[0], 0).wait()
    finally:
        th.join(60)
        destroy_group(pg)
    assert not th.is_alive() and len(got) == 3
    for u, (plan, received) in enumerate(zip(updates, got, strict=True)):
        want = [(s.name, (torch.arange(s.shape[0]) + 100 * u).tolist()) for specs in plan for s in specs]
        assert [(n, t.tolist()) for n, t in received] == want
    assert ptrs[0] == ptrs[1] and [n for _, n in ptrs[0]] == [64, 128]
    assert ptrs[2][0] == ptrs[0][0] and ptrs[2][1][1] == 192
