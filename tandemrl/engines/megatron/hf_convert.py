"""HF safetensors <-> megatron-core GPTModel shards (TP / PP / EP), by a hand-written name/layout mapping.

The same ordered entry list (built from the HF config alone, so identical on every rank) drives loading,
exporting and the ParamSpec list that inference servers allocate receive buffers from. Layouts:
- linear_qkv: per query group [q (heads_per_group * D), k (D), v (D)] rows; TP splits the groups;
- linear_fc1: cat(gate_shard, up_shard) per TP rank; linear_proj / linear_fc2: split on dim 1;
- embedding / output layer: rows padded to a multiple of TP, split on dim 0.

Critics (``critic=True``, HF's ``<Arch>ForTokenClassification``): the same backbone, then ``score.weight``
(1, H) and ``score.bias`` (if HF has one) in place of lm_head, on the value head of value_head.py, laid out
as an output layer of vocab size 1 (padded to TP rows). A causal-LM checkpoint (no ``score.*``) gives a
critic HF's fresh head (seeded) and its lm_head is ignored, as ``from_pretrained`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandemrl.engines.megatron.model import head_dim, moe_layer_pattern, padded_vocab_size, shared_expert_size
from tandemrl.engines.megatron.value_head import NUM_LABELS, OUTPUT_LAYER, head_bias, initial_head_weights

if TYPE_CHECKING:
    from tandemrl.api.inference import ParamSpec


@dataclass(frozen=True)
class _Entry:
    """One Megatron parameter and the HF tensors it is made of."""

    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    mc: tuple[str, ...]  # candidate names ({l}: local layer index, {e}: local expert index); TE vs local spec
    kind: str  # vocab | rep | qkv | row | fc1
    stage: str  # first | last | layer
    layer: int | None = None
    expert: int | None = None
    load_only: bool = False  # the tied output layer on the last PP stage: loaded, never exported


def _entries(hf_config: Any, critic: bool = False) -> list[_Entry]:
    """All parameters of the model (the critic's, with a value head instead of lm_head) in HF export order."""
    c = hf_config
    H, V = c.hidden_size, c.vocab_size
    out = [_Entry(("model.embed_tokens.weight",), ((V, H),), ("embedding.word_embeddings.weight",), "vocab", "first")]
    pattern = moe_layer_pattern(c)
    for li in range(c.num_hidden_layers):
        add = _layer_adder(out, li)
        _attention_entries(c, add)
        if pattern[li]:
            _moe_entries(c, add)
        else:
            F = c.intermediate_size
            add(("mlp.gate_proj.weight", "mlp.up_proj.weight"), ((F, H), (F, H)), ("mlp.linear_fc1.weight",), "fc1")
            add(("mlp.down_proj.weight",), ((H, F),), ("mlp.linear_fc2.weight",), "row")
    out.append(_Entry(("model.norm.weight",), ((H,),), ("decoder.final_layernorm.weight",), "rep", "last"))
    return out + _head_entries(c, critic)


def _layer_adder(out: list[_Entry], li: int) -> Callable[..., None]:
    """``add(hf, shapes, mc, kind, **kw)`` appends an entry of layer ``li`` (names relative to the layer)."""
    p, m = f"model.layers.{li}.", "decoder.layers.{l}."

    def add(hf: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], mc: tuple[str, ...], kind: str, **kw: Any):
        out.append(_Entry(tuple(p + n for n in hf), shapes, tuple(m + n for n in mc), kind, "layer", li, **kw))

    return add


def _attention_entries(c: Any, add: Callable[..., None]) -> None:
    """Input norm, fused QKV (with Qwen2's biases or Qwen3's q/k norms), output projection, pre-MLP norm."""
    H, D = c.hidden_size, head_dim(c)
    nq, nkv = c.num_attention_heads * D, c.num_key_value_heads * D
    add(
        ("input_layernorm.weight",),
        ((H,),),
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        "rep",
    )
    qkv = tuple(f"self_attn.{x}_proj.weight" for x in "qkv")
    add(qkv, ((nq, H), (nkv, H), (nkv, H)), ("self_attention.linear_qkv.weight",), "qkv")
    if c.model_type in ("qwen2", "qwen2_moe"):
        qkv_bias = tuple(f"self_attn.{x}_proj.bias" for x in "qkv")
        add(qkv_bias, ((nq,), (nkv,), (nkv,)), ("self_attention.linear_qkv.bias",), "qkv")
    if c.model_type in ("qwen3", "qwen3_moe"):
        add(("self_attn.q_norm.weight",), ((D,),), ("self_attention.q_layernorm.weight",), "rep")
        add(("self_attn.k_norm.weight",), ((D,),), ("self_attention.k_layernorm.weight",), "rep")
    add(("self_attn.o_proj.weight",), ((H, nq),), ("self_attention.linear_proj.weight",), "row")
    post_norm = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    add(("post_attention_layernorm.weight",), ((H,),), post_norm, "rep")


def _moe_entries(c: Any, add: Callable[..., None]) -> None:
    """Router, every expert's fc1/fc2, and the shared expert (with its gate) if the model has one."""
    H, F, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
    add(("mlp.gate.weight",), ((E, H),), ("mlp.router.weight",), "rep")
    for ex in range(E):
        x, mx = f"mlp.experts.{ex}.", "mlp.experts.local_experts.{e}."
        gate_up = (x + "gate_proj.weight", x + "up_proj.weight")
        add(gate_up, ((F, H), (F, H)), (mx + "linear_fc1.weight",), "fc1", expert=ex)
        add((x + "down_proj.weight",), ((H, F),), (mx + "linear_fc2.weight",), "row", expert=ex)
    S = shared_expert_size(c)
    if S:
        x, mx = "mlp.shared_expert.", "mlp.shared_experts."
        add((x + "gate_proj.weight", x + "up_proj.weight"), ((S, H), (S, H)), (mx + "linear_fc1.weight",), "fc1")
        add((x + "down_proj.weight",), ((H, S),), (mx + "linear_fc2.weight",), "row")
        add(("mlp.shared_expert_gate.weight",), ((1, H),), (mx + "gate_weight",), "rep")


def _head_entries(c: Any, critic: bool) -> list[_Entry]:
    """The output layer: a critic's value head, the tied embedding (loaded, not exported) or lm_head."""
    H, V = c.hidden_size, c.vocab_size
    if critic:  # the value head: an untied output layer of NUM_LABELS rows (tie_word_embeddings is moot)
        head = [_Entry(("score.weight",), ((NUM_LABELS, H),), (f"{OUTPUT_LAYER}.weight",), "vocab", "last")]
        if head_bias(c):
            head.append(_Entry(("score.bias",), ((NUM_LABELS,),), (f"{OUTPUT_LAYER}.bias",), "vocab", "last"))
        return head
    if getattr(c, "tie_word_embeddings", False):
        return [
            _Entry(("model.embed_tokens.weight",), ((V, H),), ("output_layer.weight",), "vocab", "last", load_only=True)
        ]
    return [_Entry(("lm_head.weight",), ((V, H),), ("output_layer.weight",), "vocab", "last")]


def hf_param_specs(hf_config: Any, dtype: torch.dtype | None = None, *, critic: bool = False) -> list[ParamSpec]:
    """(name, shape, dtype) of every tensor iter_hf_weights yields, in its order (dtype: the model's params)."""
    from tandemrl.api.inference import ParamSpec

    if dtype is None:
        dtype = _hf_dtype(hf_config)
    name = str(dtype).removeprefix("torch.")
    return [
        ParamSpec(n, tuple(s), name)
        for en in _entries(hf_config, critic)
        if not en.load_only
        for n, s in zip(en.hf, en.shapes, strict=True)
    ]


def _hf_dtype(hf_config: Any) -> torch.dtype:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, d) if isinstance(d, str) else d


# ----------------------------------------------------------------------------- layouts


def _to_shard(en: _Entry, hf: list[torch.Tensor], hf_config: Any, tp: int, r: int) -> torch.Tensor:
    """This TP rank's Megatron shard of an entry from its full HF tensors."""
    if en.kind == "rep":
        return hf[0]
    if en.kind == "vocab":
        w = hf[0]
        rows = padded_vocab_size(w.shape[0], tp)
        if rows != w.shape[0]:
            w = torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])
        return w.chunk(tp, 0)[r]
    if en.kind == "row":
        return hf[0].chunk(tp, 1)[r]
    if en.kind == "fc1":
        return torch.cat([hf[0].chunk(tp, 0)[r], hf[1].chunk(tp, 0)[r]])
    if en.kind == "qkv":
        ng, d = hf_config.num_key_value_heads, head_dim(hf_config)
        if ng % tp:
            raise ValueError(f"num_key_value_heads={ng} must be divisible by tensor parallel size {tp}")
        hpg = hf_config.num_attention_heads // ng
        rest = hf[0].shape[1:]
        q, k, v = hf[0].reshape(ng, hpg * d, *rest), hf[1].reshape(ng, d, *rest), hf[2].reshape(ng, d, *rest)
        return torch.cat([q, k, v], 1).chunk(tp, 0)[r].reshape(-1, *rest)
    raise AssertionError(en.kind)


def _from_shards(en: _Entry, shards: list[torch.Tensor], hf_config: Any) -> list[torch.Tensor]:
    """Full HF tensors of an entry from all TP shards (in TP rank order)."""
    if en.kind == "rep":
        return [shards[0]]
    if en.kind == "vocab":  # drop the padding rows (vocab size, or NUM_LABELS for the value head)
        return [torch.cat(shards, 0)[: en.shapes[0][0]]]
    if en.kind == "row":
        return [torch.cat(shards, 1)]
    if en.kind == "fc1":
        n = shards[0].shape[0] // 2
        return [torch.cat([s[:n] for s in shards]), torch.cat([s[n:] for s in shards])]
    if en.kind == "qkv":
        ng, d = hf_config.num_key_value_heads, head_dim(hf_config)
        hpg = hf_config.num_attention_heads // ng
        full = torch.cat(shards, 0)
        rest = full.shape[1:]
        q, k, v = full.reshape(ng, (hpg + 2) * d, *rest).split([hpg * d, d, d], 1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise AssertionError(en.kind)


# ----------------------------------------------------------------------------- this rank's view


def _unwrap(model: Any) -> Any:
    """GPTModel under DDP / Float16Module wrappers."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("virtual pipeline stages (a list of model chunks) are not supported")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


class _Local:
    """Which entries this rank holds, under which parameter, and its TP group for them."""

    def __init__(self, model: Any) -> None:
        from megatron.core import parallel_state as ps

        self.model = _unwrap(model)
        self.params = dict(self.model.named_parameters())
        self.is_first = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.layers = {}  # global layer -> local index
        self.n_local_experts = 0
        for i, layer in enumerate(self.model.decoder.layers):
            self.layers[layer.layer_number - 1] = i
            experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
            if experts is not None:
                self.n_local_experts = len(experts)
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.tp = (
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
        )
        self.etp = (
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        )

    def owns(self, en: _Entry) -> bool:
        if en.stage == "first":
            return self.is_first
        if en.stage == "last":
            return self.is_last
        if en.layer not in self.layers:
            return False
        return en.expert is None or en.expert // self.n_local_experts == self.ep_rank

    def param(self, en: _Entry) -> torch.nn.Parameter | None:
        """The parameter of an owned entry (None for a tied output layer that shares the embedding)."""
        fmt: dict[str, int] = {}
        if en.layer is not None:
            fmt["l"] = self.layers[en.layer]
        if en.expert is not None:
            fmt["e"] = en.expert - self.ep_rank * self.n_local_experts
        for cand in en.mc:
            p = self.params.get(cand.format(**fmt))
            if p is not None:
                return p
        if en.load_only:
            return None
        raise KeyError(f"model has none of {[c.format(**fmt) for c in en.mc]} for HF {en.hf}")

    def group(self, en: _Entry) -> tuple[Any, int, int]:
        return self.etp if en.expert is not None else self.tp


# ----------------------------------------------------------------------------- load


def _index_checkpoint(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {hf_dir}")
    where: dict[str, str] = {}
    for name in files:
        with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
            where.update({k: os.path.join(hf_dir, name) for k in f.keys()})
    return where


def load_hf_weights(model: Any, hf_dir: str, hf_config: Any, *, critic: bool = False, seed: int = 0) -> None:
    """Copy this rank's TP/PP/EP shard of the HF checkpoint into ``model``; every name must match both ways.

    ``critic``: ``model`` carries the value head. Loaded from a checkpoint without ``score.*`` (a causal LM),
    the head gets HF's seeded initialisation (``seed``: the engine's, as HF's ``torch.manual_seed``).
    """
    from safetensors import safe_open

    entries = _entries(hf_config, critic)
    where = _index_checkpoint(hf_dir)
    expected = {n for en in entries for n in en.hf}
    fresh: dict[str, torch.Tensor] = {}
    if critic and not any(n.startswith("score.") for n in where):
        fresh = initial_head_weights(hf_config, seed)
    missing = sorted(expected - set(where) - set(fresh))
    ignored = {"lm_head.weight"} if critic or hf_config.tie_word_embeddings else set()
    unexpected = sorted(set(where) - expected - ignored)
    if missing or unexpected:
        raise ValueError(
            f"{hf_dir}: checkpoint does not match the {hf_config.model_type} config: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    local = _Local(model)
    handles: dict[str, Any] = {}
    assigned: set[int] = set()
    try:
        for en in entries:
            if not local.owns(en):
                continue
            param = local.param(en)
            if param is None:
                continue
            hf = []
            for name, shape in zip(en.hf, en.shapes, strict=True):
                if name in fresh:
                    hf.append(fresh[name])
                    continue
                path = where[name]
                if path not in handles:
                    handles[path] = safe_open(path, framework="pt")
                t = handles[path].get_tensor(name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, the config implies {shape}")
                hf.append(t)
            _, tp, r = local.group(en)
            shard = _to_shard(en, hf, hf_config, tp, r)
            if shard.shape != param.shape:
                raise ValueError(f"{en.hf}: shard shape {tuple(shard.shape)} != Megatron param {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)
            assigned.add(id(param))
    finally:
        handles.clear()
    left = sorted(n for n, p in local.params.items() if id(p) not in assigned)
    if left:
        raise ValueError(f"{hf_dir}: no HF tensor maps to Megatron parameter(s) {left[:8]}")


# ----------------------------------------------------------------------------- export


def _owner_table(local: _Local) -> list[dict[str, Any]]:
    """Every world rank's (pp stage flags, global layers, ep rank, local experts), for picking broadcast sources."""
    info = {
        "first": local.is_first,
        "last": local.is_last,
        "layers": sorted(local.layers),
        "ep": local.ep_rank,
        "n_exp": local.n_local_experts,
    }
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, info)
    return table


def _rank_owns(info: dict[str, Any], en: _Entry) -> bool:
    if en.stage == "first":
        return info["first"]
    if en.stage == "last":
        return info["last"]
    if en.layer not in info["layers"]:
        return False
    return en.expert is None or en.expert // info["n_exp"] == info["ep"]


def iter_hf_weights(model: Any, hf_config: Any, *, critic: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors (unsharded, real vocab rows), same order and contents on every rank.

    Collective: every rank must drain the iterator. TP shards are all-gathered inside the owning stage,
    then the owner broadcasts to the world unless every rank already holds the tensor (PP=1, non-expert).
    Tensors live on the parameters' device, in their dtype.
    """
    local = _Local(model)
    table = _owner_table(local)
    me = dist.get_rank()
    # Some params (e.g. the MoE router, kept in fp32) differ from params_dtype: export everything in params_dtype,
    # the dtype hf_param_specs announces, so broadcast buffers and receivers agree.
    dtype = local.model.config.params_dtype
    device = next(iter(local.params.values())).device
    for en in _entries(hf_config, critic):
        if en.load_only:
            continue
        owners = [r for r, info in enumerate(table) if _rank_owns(info, en)]
        if not owners:
            raise RuntimeError(f"no rank holds {en.hf} (layer {en.layer}, expert {en.expert})")
        if me in owners:
            param = local.param(en)
            assert param is not None
            group, size, _ = local.group(en)
            shard = param.detach()
            if size > 1:
                shards = [torch.empty_like(shard) for _ in range(size)]
                dist.all_gather(shards, shard.contiguous(), group=group)
            else:
                shards = [shard]
            tensors = [t.to(dtype).contiguous() for t in _from_shards(en, shards, hf_config)]
        else:
            tensors = [torch.empty(s, dtype=dtype, device=device) for s in en.shapes]
        if len(owners) < len(table):
            for t in tensors:
                dist.broadcast(t, src=owners[0])
        yield from zip(en.hf, tensors, strict=True)
