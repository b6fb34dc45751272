"""Delta encoding of weight buckets (tandemrl.weights.delta): hand values, round trips, errors.

The receive side runs over a real 2-rank gloo weight-update group (two threads of this process).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from utils import free_port

from tandemrl.api.inference import ParamSpec
from tandemrl.weights import delta as wd
from tandemrl.weights.group import destroy_group, host_group, join_group
from tandemrl.weights.wire import pack_bucket

MASK64 = (1 << 64) - 1


def flat_of(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` then zeros, as a 64-byte uint8 bucket."""
    t = torch.zeros(64 // dtype.itemsize, dtype=dtype)
    t[: len(values)] = torch.tensor(values, dtype=torch.float32).to(dtype)
    return t.view(torch.uint8)


def signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def test_checksum_hand_values_bf16_and_fp32() -> None:
    # bf16 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00; int64 word 0 holds elements 0-3, word 1 elements 4-7.
    w0, w1 = 0x0000_3F00_C000_3F80, 0x3F80
    assert wd.checksum(flat_of([1.0, -2.0, 0.5, 0.0, 1.0], torch.bfloat16)) == (w0 + w1, w0 + 2 * w1)
    # fp32 1.0 = 0x3F800000, -2.0 = 0xC0000000: word 0 = -2.0 (high half) | 1.0 (low half).
    w0 = signed(0xC000_0000_3F80_0000)
    assert wd.checksum(flat_of([1.0, -2.0], torch.float32)) == (w0, w0)
    # Sums wrap modulo 2**64.
    big = torch.zeros(8, dtype=torch.int64)
    big[0], big[1] = 2**63 - 1, 1
    assert wd.checksum(big.view(torch.uint8)) == (-(2**63), signed(2**63 - 1 + 2))


def test_checksum_sees_moved_words() -> None:
    a = flat_of([1.0, 2.0, 3.0, 4.0], torch.float32)
    b = flat_of([1.0, 2.0, 4.0, 3.0], torch.float32)  # same words, two swapped: same plain sum
    assert wd.checksum(a)[0] != wd.checksum(b)[0] or wd.checksum(a)[1] != wd.checksum(b)[1]
    w = a.view(torch.int64).clone()
    w[[0, 1]] = w[[1, 0]]
    swapped = w.view(torch.uint8)
    assert wd.checksum(swapped)[0] == wd.checksum(a)[0] and wd.checksum(swapped)[1] != wd.checksum(a)[1]


@pytest.mark.parametrize(
    ("dtype", "old", "new", "xor_payload", "sparse_payload", "changed"),
    [
        # bf16 2.0 = 0x4000 -> 2.015625 = 0x4001 in element (= word) 1.
        (torch.bfloat16, [1.0, 2.0, 3.0], [1.0, 2.015625, 3.0], [0b10, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0x01, 0x40], 1),
        # fp32 1.0 = 0x3F800000 -> next float 0x3F800001 in element 2: its low 16-bit word is word 4.
        (
            torch.float32,
            [0.0, 0.0, 1.0],
            [0.0, 0.0, 1.0000001192092896],
            [0b1_0000, 0, 0, 0, 1, 0],
            [4, 0, 0, 0, 1, 0],
            1,
        ),
    ],
)
def test_encode_hand_values(
    dtype: torch.dtype,
    old: list[float],
    new: list[float],
    xor_payload: list[int],
    sparse_payload: list[int],
    changed: int,
) -> None:
    a, b = flat_of(new, dtype), flat_of(old, dtype)
    assert wd.encode(wd.XOR, a, b).tolist() == xor_payload
    assert wd.encode(wd.SPARSE, a, b).tolist() == sparse_payload
    assert wd.changed_elements(a, b, [(0, 64, dtype.itemsize)]) == changed
    for kind, payload in ((wd.XOR, xor_payload), (wd.SPARSE, sparse_payload)):
        base = b.clone()
        wd.decode_(kind, torch.tensor(payload, dtype=torch.uint8), base)
        assert torch.equal(base, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [wd.XOR, wd.SPARSE, wd.FULL])
def test_round_trip_after_small_updates(dtype: torch.dtype, kind: int) -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(4096, generator=g) * 0.02
    old = master.to(dtype).view(torch.uint8).clone()
    step = torch.randn(4096, generator=g) * 1e-4 * (torch.arange(4096) % 3 == 0)  # a third of them move
    new = (master + step).to(dtype).view(torch.uint8).clone()
    changed = wd.changed_elements(new, old, [(0, new.numel(), dtype.itemsize)])
    assert 0 < changed < 4096  # some elements keep their bits, others not
    base = old.clone()
    wd.decode_(kind, wd.encode(kind, new, old), base)
    assert torch.equal(base, new)
    same = old.clone()
    wd.decode_(kind, wd.encode(kind, old, old), same)
    assert torch.equal(same, old)
    if kind == wd.SPARSE:
        assert wd.encode(kind, old, old).numel() == 0
    if kind == wd.XOR:
        assert wd.encode(kind, old, old).numel() == old.numel() // 16  # the mask alone


def test_decode_rejects_bad_payloads() -> None:
    base = flat_of([1.0], torch.bfloat16)
    with pytest.raises(ValueError, match="6 per word"):
        wd.decode_(wd.SPARSE, torch.zeros(5, dtype=torch.uint8), base)
    with pytest.raises(ValueError, match="index out of"):
        wd.decode_(wd.SPARSE, torch.tensor([32, 0, 0, 0, 1, 0], dtype=torch.uint8), base)
    with pytest.raises(ValueError, match="mask marks 1 words, 0 sent"):
        wd.decode_(wd.XOR, torch.tensor([1, 0, 0, 0], dtype=torch.uint8), base)
    with pytest.raises(ValueError, match="multiple of 64 bytes"):
        wd.checksum(torch.zeros(8, dtype=torch.uint8))


class Receiver(threading.Thread):
    """Rank 1 of a real gloo weight-update group, running receive_delta_buckets."""

    def __init__(self, port: int, specs: list[ParamSpec], base: list[torch.Tensor]) -> None:
        super().__init__(daemon=True)
        self.port, self.specs, self.base = port, specs, base
        self.error: BaseException | None = None
        self.got: list[tuple[str, torch.Tensor]] = []

    def run(self) -> None:
        pg = join_group("127.0.0.1", self.port, 2, 1, "gloo", timeout_s=60)
        try:
            self.got = [(n, t.clone()) for n, t in wd.receive_delta_buckets(pg, [self.specs], "cpu", self.base)]
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            destroy_group(pg)


def send(
    kind: int, new: torch.Tensor, old: torch.Tensor, specs: list[ParamSpec], base: list[torch.Tensor], **h: Any
) -> Receiver:
    port = free_port()
    rx = Receiver(port, specs, base)
    rx.start()
    pg = host_group("127.0.0.1", port, 2, "gloo", timeout_s=60)
    try:
        payload = wd.encode(kind, new, old)
        ck = h.get("checksum", wd.checksum(new))
        pg.broadcast(wd.header(kind, payload.numel(), ck, new.device), 0).wait()
        pg.broadcast(payload.clone(), 0).wait()
        rx.join(60)
        assert not rx.is_alive()
    finally:
        destroy_group(pg)
    return rx


def test_receive_applies_delta_and_rejects_a_bad_checksum() -> None:
    w_old = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    w_new = torch.tensor([1.0, 2.015625, 3.0], dtype=torch.bfloat16)
    old, specs = pack_bucket([("w", w_old)])
    new, _ = pack_bucket([("w", w_new)])
    base = [old.clone()]
    rx = send(wd.SPARSE, new, old, specs, base)
    assert rx.error is None and len(rx.got) == 1 and torch.equal(rx.got[0][1], w_new)
    assert torch.equal(base[0], new)
    # A wrong checksum (e.g. a base that drifted) is a one-line error, never silently loaded.
    rx = send(wd.SPARSE, new, old, specs, [old.clone()], checksum=(1, 2))
    assert isinstance(rx.error, RuntimeError) and not rx.got
    assert "bucket 0 (sparse) checksum" in str(rx.error) and "\n" not in str(rx.error)
    # A delta with no base on the server.
    rx = send(wd.XOR, new, old, specs, [])
    assert isinstance(rx.error, RuntimeError) and "holds no base" in str(rx.error)
