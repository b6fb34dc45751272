"""Parse `allocation_mode` strings: which backends run where, and how each is parallelised.

Grammar (whitespace is ignored)::

    spec    := group ("+" group)*            # "+": components on disjoint devices
    group   := member ("|" member)*          # "|": colocated, share the same devices
    member  := BACKEND ["[" NAME "]"] ":" body
             | BACKEND "." dims              # legacy dotted form, e.g. sglang.d4p1t1
             | dims                          # bare training dims (legacy), e.g. d4p1t1
    body    := dims | "(" "attn:" dims "|" "ffn:" dims ")"   # MoE hybrid (megatron only)
    dims    := (LETTER SIZE)+                # letters d t p c e, any order, missing = 1

This module reads the syntax only. Which backend names exist, whether each one trains or
serves, and which dims it may set above 1 come from the caller as a table of
:class:`BackendShape` (``tandemrl.configs.backends.BACKEND_TABLES``, which
``tandemrl.configs.backends.parse_allocation`` uses: each backend class declares its ``parallel_dims``).
Bare dims are a training component: ``megatron`` if p>1 or e>1, else ``fsdp``. A component's
world size is d*t*p*c; expert parallelism (e) reuses those devices and must divide the devices
of one pipeline stage (d*t*c).

MoE hybrid ``megatron:(attn:d2p1t2c1|ffn:d1p1t2e2)`` (a backend whose shape has
``moe_hybrid``) gives attention and expert layers different layouts on the same devices: attn
uses d, t, p, c; ffn uses d (expert data parallel), t (expert tensor parallel), p and e. Both
must cover the same number of devices and share p.

Names tell apart several components of one kind (``fsdp[actor]:d2|fsdp[ref]:d2``). Every
member must be named once a spec has 3 or more members, or 2 or more of the same kind.
With several inference components, the one named ``gen`` (else the first) serves the policy's
generations; the others are auxiliary servers (``vllm[gen]:d1+vllm[judge]:d1+fsdp[actor]:d1``)
whose models the config names (``aux_servers.<name>.path``).

Examples: ``fsdp:d2``, ``d8``, ``vllm:d2t2+fsdp:d4``, ``sglang.d4p1t1+d4p1t1``,
``sglang[gen]:d2+fsdp[actor]:d2|fsdp[ref]:d2``. ``str(AllocationMode)`` prints a canonical
form (explicit backends, d always shown, other dims only when >1) that parses back to an
equal object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandemrl.api.parallel import ParallelStrategy

# Dimension letter -> ParallelStrategy field, in canonical print order.
DIM_LETTERS: dict[str, str] = {"d": "dp", "t": "tp", "p": "pp", "c": "cp", "e": "ep"}
# The grammar's legacy shorthand: bare dims name a training component of one of these.
_BARE_DIMS = ("fsdp", "megatron")  # (no p or e, with p or e)
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}


class AllocationValidationError(ValueError):
    """A malformed or unsupported allocation_mode; the message names the offending token."""


@dataclass(frozen=True)
class BackendShape:
    """What the parser needs to know of one backend, as its class declares it.

    ``kind``: "training" or "inference". ``dims``: the letters (of d, t, p, c, e) it may set
    above 1. ``moe_hybrid``: whether it takes the ``(attn:...|ffn:...)`` body. ``features``: what
    it can do beyond its protocol (the class's ``features``: ``TRAINING_FEATURES`` or ``SERVER_FEATURES``),
    carried on each parsed component so callers ask the component, never the backend's name.
    """

    kind: Literal["training", "inference"]
    dims: str
    moe_hybrid: bool = False
    features: frozenset[str] = frozenset()


# What a training backend class may list in ``features``.
TRAINING_FEATURES = {
    "lora": "trains LoRA adapters (engine.lora.rank > 0)",
    "router_replay": "replays the behaviour policy's MoE routing (megatron.router_replay)",
    "fp32_head": "computes the output head's logits in fp32 (engine.head_dtype: float32)",
}
# What an inference backend class may list in ``features``.
SERVER_FEATURES = {
    "token": "its servers require the run's token on every request (the launchers make one per run)",
    "middleware": "its server command takes ASGI middleware (token checks, request logs)",
    "lora_adapters": "its servers load LoRA adapters at run time (``lora_flags`` start them so)",
    "judge": "serves a reward judge's constrained chat completions (reward_service.judge)",
}


class LazyShapes(Mapping[str, BackendShape]):
    """A registry's rows (name -> ``"module:Class"`` or a class) seen as shapes.

    A row in ``known`` (the registry's copy of what its built-in classes declare) is answered
    without importing anything, so parsing ``allocation_mode`` imports no engine or torch; any
    other row's class is imported, and its ``parallel_dims`` / ``moe_hybrid`` / ``features`` read,
    when that name is looked up (:meth:`declared` always reads the class).
    """

    def __init__(
        self,
        kind: Literal["training", "inference"],
        rows: Mapping[str, object],
        load: Callable[[str], Any],
        known: Mapping[str, BackendShape] | None = None,
    ):
        self._kind, self._rows, self._load = kind, rows, load
        self._known = known if known is not None else {}

    def __getitem__(self, name: str) -> BackendShape:
        if name not in self._rows:
            raise KeyError(name)
        if name in self._known:
            return self._known[name]
        return self.declared(name)

    def declared(self, name: str) -> BackendShape:
        """The shape ``name``'s class declares, read from the imported class."""
        cls = self._load(name)
        features = frozenset(getattr(cls, "features", ()))
        return BackendShape(self._kind, str(cls.parallel_dims), bool(getattr(cls, "moe_hybrid", False)), features)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


_Tables = tuple[Mapping[str, BackendShape], ...]


@dataclass(frozen=True)
class AllocationComponent:
    """One backend instance: its kind, parallel layout and which device group it occupies.

    Components with the same ``group`` are colocated (joined by ``|``) and share devices.
    """

    name: str | None
    backend: str
    kind: str  # "inference" or "training"
    strategy: ParallelStrategy
    group: int = 0
    features: frozenset[str] = field(default=frozenset(), compare=False)  # the backend's (BackendShape.features)

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_moe_hybrid(self) -> bool:
        """True when attention and expert layers need separate layouts to describe."""
        return self.strategy.etp > 1

    def __str__(self) -> str:
        s = self.strategy
        label = f"{self.backend}[{self.name}]" if self.name else self.backend
        if self.is_moe_hybrid:
            edp = s.world_size // (s.pp * s.etp * s.ep)
            attn = _format_dims({"d": s.dp, "t": s.tp, "p": s.pp, "c": s.cp})
            ffn = _format_dims({"d": edp, "t": s.etp, "p": s.pp, "e": s.ep})
            return f"{label}:(attn:{attn}|ffn:{ffn})"
        return f"{label}:{_format_dims({'d': s.dp, 't': s.tp, 'p': s.pp, 'c': s.cp, 'e': s.ep})}"


@dataclass
class AllocationMode:
    """Parsed allocation_mode; build it with :meth:`from_str`."""

    components: list[AllocationComponent] = field(default_factory=list)
    spec: str = field(default="", compare=False)  # the string as written (error messages quote it)

    @classmethod
    def from_str(cls, spec: str, *backends: Mapping[str, BackendShape]) -> AllocationMode:
        """Parse ``spec`` and check it against the backend tables; AllocationValidationError on bad input.

        ``backends``: name -> :class:`BackendShape` tables, looked up in order
        (``tandemrl.configs.backends.BACKEND_TABLES``); a table may resolve its rows lazily.
        """
        table = tuple(backends)
        if not isinstance(spec, str):
            raise AllocationValidationError(f"allocation_mode must be a string, got {type(spec).__name__}")
        text = "".join(spec.split())
        if not text:
            raise AllocationValidationError("allocation_mode is empty; expected e.g. 'vllm:d1+fsdp:d1'")
        components: list[AllocationComponent] = []
        tokens: list[str] = []
        for group_id, group in enumerate(_split_top(text, "+")):
            if not group:
                raise AllocationValidationError(f"empty component between '+' in allocation_mode {text!r}")
            for member in _split_top(group, "|"):
                if not member:
                    raise AllocationValidationError(f"empty component next to '|' in {group!r}")
                components.append(_parse_member(member, group_id, table))
                tokens.append(member)
        _check_names(components, tokens)
        return cls(components, spec)

    # ---- lookups -------------------------------------------------------------------------

    @property
    def groups(self) -> list[list[AllocationComponent]]:
        """Components per disjoint device group, in spec order."""
        out: dict[int, list[AllocationComponent]] = {}
        for c in self.components:
            out.setdefault(c.group, []).append(c)
        return list(out.values())

    @property
    def gen(self) -> AllocationComponent | None:
        """The generation servers: the inference component named ``gen``, else the first; None if none."""
        inference = [c for c in self.components if c.kind == "inference"]
        return next((c for c in inference if c.name == "gen"), inference[0] if inference else None)

    @property
    def aux(self) -> list[AllocationComponent]:
        """Auxiliary inference components (a judge, a teacher): every inference component but :attr:`gen`."""
        gen = self.gen
        return [c for c in self.components if c.kind == "inference" and c is not gen]

    @property
    def train(self) -> AllocationComponent | None:
        """The (first) training component, or None for inference-only specs."""
        return next((c for c in self.components if c.kind == "training"), None)

    @property
    def gen_backend(self) -> str | None:
        return self.gen.backend if self.gen else None

    @property
    def train_backend(self) -> str | None:
        return self.train.backend if self.train else None

    @property
    def gen_world_size(self) -> int:
        """Devices of the inference component; 0 if there is none."""
        return self.gen.world_size if self.gen else 0

    @property
    def train_world_size(self) -> int:
        """Devices of the training component; 0 if there is none."""
        return self.train.world_size if self.train else 0

    @property
    def total_world_size(self) -> int:
        """Devices the whole spec needs: colocated members count once (their maximum)."""
        return sum(max(c.world_size for c in g) for g in self.groups)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components if c.name]

    def get(self, name: str) -> AllocationComponent:
        """Component called ``name``; KeyError (one line, listing names) if absent."""
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no allocation component named {name!r}; named components: {self.names}")

    def colocated(self, a: AllocationComponent, b: AllocationComponent) -> bool:
        """Whether two components of this spec share devices."""
        return a.group == b.group

    def __str__(self) -> str:
        return "+".join("|".join(str(c) for c in g) for g in self.groups)


# ---- parsing helpers -----------------------------------------------------------------------


def _format_dims(dims: dict[str, int]) -> str:
    """Canonical dims: d always, the rest only when larger than 1."""
    return "".join(f"{k}{v}" for k, v in dims.items() if k == "d" or v > 1)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside parentheses, so a hybrid body's '|' stays inside its member."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise AllocationValidationError(f"unbalanced ')' in {text!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise AllocationValidationError(f"unbalanced '(' in {text!r}")
    parts.append(text[start:])
    return parts


def _parse_dims(body: str, token: str) -> dict[str, int]:
    """Read ``d4t2``-style sizes; unspecified letters default to 1."""
    if not body:
        raise AllocationValidationError(f"no parallel dims in {token!r}; expected e.g. 'd2t1'")
    sizes: dict[str, int] = {}
    i, n = 0, len(body)
    while i < n:
        letter = body[i]
        if not letter.isalpha():
            raise AllocationValidationError(f"unexpected {letter!r} in dims {body!r} of {token!r}")
        if letter not in DIM_LETTERS:
            raise AllocationValidationError(f"unknown dimension letter {letter!r} in {token!r}; use d, t, p, c or e")
        j = i + 1
        if j < n and body[j] == "-":
            j += 1
        while j < n and body[j] in "0123456789":
            j += 1
        digits = body[i + 1 : j]
        if digits in ("", "-"):
            raise AllocationValidationError(f"dimension {letter!r} has no size in {token!r}")
        if letter in sizes:
            raise AllocationValidationError(f"repeated dimension {letter!r} in {token!r}")
        size = int(digits)
        if size <= 0:
            raise AllocationValidationError(f"size of {letter + digits!r} must be positive in {token!r}")
        sizes[letter] = size
        i = j
    return {k: sizes.get(k, 1) for k in DIM_LETTERS}


def _parse_member(token: str, group: int, table: _Tables) -> AllocationComponent:
    """Parse one ``backend[name]:body`` / legacy member into a validated component."""
    if token.startswith("("):
        raise AllocationValidationError(f"MoE hybrid {token!r} needs a backend, e.g. 'megatron:{token}'")
    cut = next((i for i, ch in enumerate(token) if ch in ":.["), None)
    if cut is None:
        if any(token in t for t in table):
            raise AllocationValidationError(f"backend {token!r} has no parallel dims; write e.g. '{token}:d1'")
        dims = _parse_dims(token, token)
        backend = _BARE_DIMS[1] if dims["p"] > 1 or dims["e"] > 1 else _BARE_DIMS[0]
        return _build(backend, _shape(backend, token, table), None, dims, None, token, group)

    backend, rest = token[:cut], token[cut:]
    if not backend:
        raise AllocationValidationError(f"missing backend before {rest[0]!r} in {token!r}")
    shape = _shape(backend, token, table)
    name = None
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise AllocationValidationError(f"unclosed '[' in {token!r}")
        name = rest[1:close]
        if not _NAME_RE.fullmatch(name):
            raise AllocationValidationError(f"bad component name {name!r} in {token!r}; use letters, digits, _ or -")
        rest = rest[close + 1 :]
    if not rest or rest[0] not in ":.":
        raise AllocationValidationError(f"expected ':' after {token[: len(token) - len(rest)]!r} in {token!r}")
    body = rest[1:]
    if body.startswith("("):
        if rest[0] == "." or not body.endswith(")"):
            raise AllocationValidationError(f"malformed MoE hybrid body {body!r} in {token!r}")
        attn, ffn = _parse_hybrid(body[1:-1], token)
        return _build(backend, shape, name, attn, ffn, token, group, table)
    return _build(backend, shape, name, _parse_dims(body, token), None, token, group)


def _shape(backend: str, token: str, table: _Tables) -> BackendShape:
    """The tables' shape of ``backend``; one line listing the known names if none has it."""
    for t in table:
        if backend in t:
            return t[backend]
    names = [n for t in table for n in t]
    raise AllocationValidationError(f"unknown backend {backend!r} in {token!r}; expected one of {names}")


def _parse_hybrid(inner: str, token: str) -> tuple[dict[str, int], dict[str, int]]:
    """Split ``attn:...|ffn:...`` (either order) into the two dim maps."""
    parts: dict[str, dict[str, int]] = {}
    for part in inner.split("|"):
        key, colon, dims = part.partition(":")
        if not colon or key not in ("attn", "ffn"):
            raise AllocationValidationError(
                f"MoE hybrid part {part!r} in {token!r} must be 'attn:<dims>' or 'ffn:<dims>'"
            )
        if key in parts:
            raise AllocationValidationError(f"repeated MoE hybrid part {key!r} in {token!r}")
        parts[key] = _parse_dims(dims, token)
    if set(parts) != {"attn", "ffn"}:
        raise AllocationValidationError(f"MoE hybrid {token!r} needs both 'attn:' and 'ffn:' parts")
    return parts["attn"], parts["ffn"]


def _build(
    backend: str,
    shape: BackendShape,
    name: str | None,
    dims: dict[str, int],
    ffn: dict[str, int] | None,
    token: str,
    group: int,
    table: _Tables = (),
) -> AllocationComponent:
    """Check backend limits and expert divisibility, then make the component."""
    if ffn is None:
        _check_allowed(backend, dims, shape.dims, token)
        strategy = ParallelStrategy(dp=dims["d"], tp=dims["t"], pp=dims["p"], cp=dims["c"], ep=dims["e"], etp=1)
    else:
        if not shape.moe_hybrid:
            hybrid = " or ".join(n for t in table for n in t if t[n].moe_hybrid)
            raise AllocationValidationError(
                f"MoE hybrid form in {token!r} is only supported by {hybrid or 'no backend'}, not {backend!r}"
            )
        _check_allowed("attn", dims, "dtpc", token)
        _check_allowed("ffn", ffn, "dtpe", token)
        attn_ws = dims["d"] * dims["t"] * dims["p"] * dims["c"]
        ffn_ws = ffn["d"] * ffn["t"] * ffn["p"] * ffn["e"]
        if attn_ws != ffn_ws:
            raise AllocationValidationError(
                f"MoE hybrid {token!r}: attn world size {attn_ws} differs from ffn world size {ffn_ws}"
            )
        if ffn["p"] != dims["p"]:
            raise AllocationValidationError(f"MoE hybrid {token!r}: ffn p{ffn['p']} must equal attn p{dims['p']}")
        strategy = ParallelStrategy(dp=dims["d"], tp=dims["t"], pp=dims["p"], cp=dims["c"], ep=ffn["e"], etp=ffn["t"])
    per_stage = strategy.world_size // strategy.pp
    if per_stage % (strategy.ep * strategy.etp) != 0:
        raise AllocationValidationError(
            f"expert parallel 'e{strategy.ep}' does not divide the ffn world of {per_stage} devices per "
            f"pipeline stage in {token!r}"
        )
    return AllocationComponent(
        name=name, backend=backend, kind=shape.kind, strategy=strategy, group=group, features=shape.features
    )


def _check_allowed(owner: str, dims: dict[str, int], allowed: str, token: str) -> None:
    """Reject a dimension above 1 that ``owner`` (a backend or hybrid part) cannot use."""
    for letter, size in dims.items():
        if size > 1 and letter not in allowed:
            raise AllocationValidationError(
                f"{owner} does not support {_DIM_NAMES[letter]} parallel {letter + str(size)!r} in {token!r}"
                f"; allowed dims: {', '.join(allowed)}"
            )


def _check_names(components: list[AllocationComponent], tokens: list[str]) -> None:
    """Names must be unique, and present wherever 'the component' would be ambiguous."""
    seen: set[str] = set()
    for c, tok in zip(components, tokens, strict=True):
        if c.name is not None:
            if c.name in seen:
                raise AllocationValidationError(f"duplicate component name {c.name!r} in {tok!r}")
            seen.add(c.name)
    for c, tok in zip(components, tokens, strict=True):
        if c.name is not None:
            continue
        hint = "gen" if c.kind == "inference" else "actor"
        if len(components) >= 3:
            raise AllocationValidationError(
                f"component {tok!r} needs a name like '{c.backend}[{hint}]:...' in a spec with 3 or more components"
            )
        if sum(o.kind == c.kind for o in components) > 1:
            raise AllocationValidationError(
                f"more than one {c.kind} component: name {tok!r}, e.g. '{c.backend}[{hint}]:...'"
            )
