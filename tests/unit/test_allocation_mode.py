"""Allocation-mode grammar: valid specs parse to the right layout, bad ones fail naming the token."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tandemrl.api.allocation import (
    AllocationComponent,
    AllocationValidationError,
)
from tandemrl.api.types import ParallelStrategy
from tandemrl.configs.backends import parse_allocation


@dataclass
class Want:
    """Expected fields of one component."""

    backend: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    name: str | None = None
    group: int = 0

    @property
    def kind(self) -> str:
        return "inference" if self.backend in ("sglang", "vllm") else "training"


# (spec, expected components in order, expected total world size)
VALID: list[tuple[str, list[Want], int]] = [
    ("fsdp:d2", [Want("fsdp", dp=2)], 2),
    ("d8", [Want("fsdp", dp=8)], 8),
    ("d2p2t1", [Want("megatron", dp=2, pp=2)], 4),
    ("d2e2", [Want("megatron", dp=2, ep=2)], 2),
    ("t2d2", [Want("fsdp", dp=2, tp=2)], 4),
    ("sglang:d4t2", [Want("sglang", dp=4, tp=2)], 8),
    ("vllm:d2p1t1", [Want("vllm", dp=2)], 2),
    ("vllm:d1t2p2", [Want("vllm", tp=2, pp=2)], 4),
    ("vllm:d2c1e1", [Want("vllm", dp=2)], 2),
    ("sglang:d4t2+fsdp:d4", [Want("sglang", dp=4, tp=2), Want("fsdp", dp=4, group=1)], 12),
    ("vllm:d2+megatron:d2p2t2", [Want("vllm", dp=2), Want("megatron", dp=2, pp=2, tp=2, group=1)], 10),
    ("sglang:d2+deepspeed:d4", [Want("sglang", dp=2), Want("deepspeed", dp=4, group=1)], 6),
    ("vllm:d1t1p1+fsdp:d2", [Want("vllm"), Want("fsdp", dp=2, group=1)], 3),
    ("sglang.d4p1t1+d4p1t1", [Want("sglang", dp=4), Want("fsdp", dp=4, group=1)], 8),
    ("vllm.d2p1t1+d2p2t1", [Want("vllm", dp=2), Want("megatron", dp=2, pp=2, group=1)], 6),
    ("sglang.d2+megatron.d2t2", [Want("sglang", dp=2), Want("megatron", dp=2, tp=2, group=1)], 6),
    ("sglang.d2+d4e2", [Want("sglang", dp=2), Want("megatron", dp=4, ep=2, group=1)], 6),
    ("fsdp:c2d2", [Want("fsdp", dp=2, cp=2)], 4),
    ("fsdp:d2t2c2", [Want("fsdp", dp=2, tp=2, cp=2)], 8),
    ("fsdp:d2c1p1e1", [Want("fsdp", dp=2)], 2),
    ("deepspeed:d4", [Want("deepspeed", dp=4)], 4),
    ("deepspeed:d2c2", [Want("deepspeed", dp=2, cp=2)], 4),
    ("megatron:d1", [Want("megatron")], 1),
    ("megatron:d3p2", [Want("megatron", dp=3, pp=2)], 6),
    ("megatron:e4d4", [Want("megatron", dp=4, ep=4)], 4),
    ("megatron:d2p2t4e4", [Want("megatron", dp=2, pp=2, tp=4, ep=4)], 16),
    ("megatron:(attn:d2p1t2c1|ffn:d1p1t2e2)", [Want("megatron", dp=2, tp=2, ep=2, etp=2)], 4),
    ("megatron:(ffn:d2t1p2e2|attn:d1t4p2)", [Want("megatron", tp=4, pp=2, ep=2)], 8),
    ("megatron:(attn:d1p1t2c2|ffn:d1p1t1e4)", [Want("megatron", tp=2, cp=2, ep=4)], 4),
    ("megatron:(attn:d4|ffn:d2e2)", [Want("megatron", dp=4, ep=2)], 4),
    ("fsdp[actor]:d2", [Want("fsdp", dp=2, name="actor")], 2),
    ("vllm:d2|fsdp:d2", [Want("vllm", dp=2), Want("fsdp", dp=2)], 2),
    ("vllm:d4|fsdp:d2", [Want("vllm", dp=4), Want("fsdp", dp=2)], 4),
    (
        "megatron[actor]:(attn:d2|ffn:d1t2)|sglang[gen]:d2",
        [Want("megatron", dp=2, etp=2, name="actor"), Want("sglang", dp=2, name="gen")],
        2,
    ),
    (
        "sglang[gen]:d2+fsdp[actor]:d2|fsdp[ref]:d2",
        [
            Want("sglang", dp=2, name="gen"),
            Want("fsdp", dp=2, name="actor", group=1),
            Want("fsdp", dp=2, name="ref", group=1),
        ],
        4,
    ),
    (
        "sglang[gen]:d2+fsdp[actor]:d4+fsdp[critic]:d2",
        [
            Want("sglang", dp=2, name="gen"),
            Want("fsdp", dp=4, name="actor", group=1),
            Want("fsdp", dp=2, name="critic", group=2),
        ],
        8,
    ),
    (
        "sglang[a]:d1+sglang[b]:d2t2+fsdp[actor_1]:d1",
        [
            Want("sglang", name="a"),
            Want("sglang", dp=2, tp=2, name="b", group=1),
            Want("fsdp", name="actor_1", group=2),
        ],
        6,
    ),
    ("  sglang:d2t4 + fsdp:d4t2\n", [Want("sglang", dp=2, tp=4), Want("fsdp", dp=4, tp=2, group=1)], 16),
]


@pytest.mark.parametrize(("spec", "want", "total"), VALID, ids=[v[0].strip() for v in VALID])
def test_valid_specs(spec: str, want: list[Want], total: int) -> None:
    mode = parse_allocation(spec)
    assert len(mode.components) == len(want)
    for comp, w in zip(mode.components, want, strict=True):
        assert comp.backend == w.backend
        assert comp.kind == w.kind
        assert comp.name == w.name
        assert comp.group == w.group
        assert comp.strategy == ParallelStrategy(dp=w.dp, tp=w.tp, pp=w.pp, cp=w.cp, ep=w.ep, etp=w.etp)
        assert comp.world_size == w.dp * w.tp * w.pp * w.cp
    assert mode.total_world_size == total
    gens = [w for w in want if w.kind == "inference"]
    trains = [w for w in want if w.kind == "training"]
    assert mode.gen_backend == (gens[0].backend if gens else None)
    assert mode.train_backend == (trains[0].backend if trains else None)
    assert mode.gen_world_size == (gens[0].dp * gens[0].tp * gens[0].pp * gens[0].cp if gens else 0)
    assert mode.train_world_size == (trains[0].dp * trains[0].tp * trains[0].pp * trains[0].cp if trains else 0)


@pytest.mark.parametrize("spec", [v[0] for v in VALID], ids=[v[0].strip() for v in VALID])
def test_round_trip(spec: str) -> None:
    mode = parse_allocation(spec)
    text = str(mode)
    again = parse_allocation(text)
    assert again == mode
    assert str(again) == text  # canonical form is a fixed point


# (spec, substring the one-line error must contain)
INVALID: list[tuple[str, str]] = [
    ("", "empty"),
    ("   ", "empty"),
    ("fsdp:d2+", "empty component"),
    ("+fsdp:d2", "empty component"),
    ("vllm:d2||fsdp:d2", "empty component"),
    ("foo:d2", "unknown backend 'foo'"),
    ("sglang:d2+FSDP:d2", "unknown backend 'FSDP'"),
    ("fsdp:d2x2", "unknown dimension letter 'x'"),
    ("d2q1", "unknown dimension letter 'q'"),
    ("fsdp:d2d4", "repeated dimension 'd'"),
    ("fsdp:d0", "'d0'"),
    ("megatron:d2t-2", "'t-2'"),
    ("fsdp:d2p2", "'p2'"),
    ("fsdp:d2e2", "'e2'"),
    ("deepspeed:d4p2", "'p2'"),
    ("deepspeed:d4e2", "'e2'"),
    ("sglang:d2e2", "'e2'"),
    ("vllm:d2c2+fsdp:d2", "'c2'"),
    ("megatron:(attn:d2t2|ffn:d1e2)", "attn world size 4 differs from ffn world size 2"),
    ("megatron:(attn:d2p2|ffn:d4p1)", "ffn p1 must equal attn p2"),
    ("megatron:(attn:d2e2|ffn:d1e2)", "'e2'"),
    ("megatron:(attn:d2|ffn:d1c2)", "'c2'"),
    ("megatron:(attn:d2)", "needs both"),
    ("megatron:(attn:d2|ffn:d1e2", "unbalanced '('"),
    ("fsdp:(attn:d2|ffn:d1e2)", "only supported by megatron"),
    ("(attn:d2|ffn:d1e2)", "needs a backend"),
    ("megatron:d3e2", "e2"),
    ("megatron:d2p2e4", "does not divide"),
    ("fsdp[a]:d2|fsdp[a]:d2", "duplicate component name 'a'"),
    ("sglang:d2+fsdp[actor]:d2+fsdp[ref]:d2", "'sglang:d2'"),
    ("sglang:d2+vllm:d2", "more than one inference"),
    ("sglang[a]:d2+vllm:d2", "'vllm:d2'"),
    ("fsdp:d2|fsdp:d2", "more than one training"),
    ("fsdp:", "no parallel dims in 'fsdp:'"),
    ("fsdp:d", "dimension 'd' has no size"),
    ("fsdp", "'fsdp' has no parallel dims"),
    ("fsdp[]:d2", "bad component name ''"),
    ("fsdp[actor]d2", "expected ':'"),
    (":d2", "missing backend"),
    ("fsdp:d2.5", "unexpected '.'"),
]


@pytest.mark.parametrize(("spec", "needle"), INVALID, ids=[repr(v[0]) for v in INVALID])
def test_invalid_specs(spec: str, needle: str) -> None:
    with pytest.raises(AllocationValidationError) as info:
        parse_allocation(spec)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_error_is_value_error_and_rejects_non_strings() -> None:
    assert issubclass(AllocationValidationError, ValueError)
    with pytest.raises(ValueError, match="must be a string"):
        parse_allocation(None)  # type: ignore[arg-type]


def test_multiline_input_still_gives_one_line_error() -> None:
    with pytest.raises(AllocationValidationError) as info:
        parse_allocation("sglang:d2\n+\nfoo:d1")
    assert "\n" not in str(info.value) and "'foo'" in str(info.value)


def test_get_names_and_colocation() -> None:
    mode = parse_allocation("sglang[gen]:d2+fsdp[actor]:d4|fsdp[ref]:d2")
    actor, ref, gen = mode.get("actor"), mode.get("ref"), mode.get("gen")
    assert isinstance(actor, AllocationComponent)
    assert (actor.world_size, ref.world_size, gen.world_size) == (4, 2, 2)
    assert mode.colocated(actor, ref) and not mode.colocated(actor, gen)
    assert mode.names == ["gen", "actor", "ref"]
    assert [[c.name for c in g] for g in mode.groups] == [["gen"], ["actor", "ref"]]
    assert mode.gen is gen and mode.train is actor
    with pytest.raises(KeyError, match="critic"):
        mode.get("critic")


def test_single_kind_specs_have_no_other_side() -> None:
    train_only = parse_allocation("fsdp:d2")
    assert train_only.gen is None and train_only.gen_backend is None and train_only.gen_world_size == 0
    gen_only = parse_allocation("vllm:d2t2")
    assert gen_only.train is None and gen_only.train_backend is None and gen_only.train_world_size == 0
    assert gen_only.total_world_size == 4


def test_canonical_form_is_explicit() -> None:
    assert str(parse_allocation("sglang.d4p1t1+d4p1t1")) == "sglang:d4+fsdp:d4"
    assert str(parse_allocation("d2p2t1")) == "megatron:d2p2"
    hybrid = str(parse_allocation("megatron:(attn:d2p1t2c1|ffn:d1p1t2e2)"))
    assert hybrid == "megatron:(attn:d2t2|ffn:d1t2e2)"
    assert str(parse_allocation("vllm:d1t1p1+fsdp[actor]:d2")) == "vllm:d1+fsdp[actor]:d2"


def test_hybrid_equivalent_to_plain_when_expert_tp_is_one() -> None:
    # Expert tensor parallel 1 means the ffn layout is fully implied by the plain form.
    hybrid = parse_allocation("megatron:(attn:d4|ffn:d2e2)")
    plain = parse_allocation("megatron:d4e2")
    assert hybrid == plain
