"""``varlen_sdpa``: an HF attention implementation for packed micro-batches.

Why it exists: with ``sdpa``/``eager``, transformers turns the restarting ``position_ids``
of a packed micro-batch into a dense ``[T, T]`` block-diagonal mask, so attention costs
O(T²) in the micro-batch's total token count T and packing loses to padding (see
bench/README.md). FlashAttention-2 avoids that with ``cu_seqlens`` but needs a GPU.
This implementation splits q/k/v at the sequence boundaries (``cu_seq_lens_q``, the
same kwargs FlashAttention-2 receives) and runs causal SDPA once per sequence, so the
cost is sum(len²), on any device and dtype, with autograd and gradient checkpointing.

Its mask function never builds the dense mask for a single unpadded row (the packed
case); every other call (padding masks, KV-cache decoding, sliding-window or custom
masks) gets the same mask plain ``sdpa`` would, and then runs exactly like ``sdpa``.
Without ``cu_seq_lens_q``, sequence boundaries come from ``position_ids`` restarts.

With the ``shared_block_cu``/``shared_block_prefix`` kwargs it runs the prefix-shared layout
of ``tandemrl.engines.prefix_sharing`` instead (a suffix block attends to its prefix block).

Only the live model uses it: the name is not saved in exported HF configs.
"""

from __future__ import annotations

from typing import Any

import torch

VARLEN_SDPA = "varlen_sdpa"


def _boundaries_from_positions(position_ids: torch.Tensor | None, n_tokens: int) -> torch.Tensor | None:
    """``cu_seqlens`` of a single packed row from where its positions stop counting up (None if one sequence)."""
    if position_ids is None or position_ids.shape[-1] != n_tokens or position_ids.reshape(-1).numel() != n_tokens:
        return None
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1
    if starts.numel() == 0:
        return None
    end = torch.tensor([n_tokens], device=starts.device)
    return torch.cat([starts.new_zeros(1), starts, end])


def _split_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int], gqa_ok: bool
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], dict[str, bool]]:
    """q/k/v split at ``lens`` along the token dim, and SDPA's GQA kwarg (k/v heads repeated where it cannot serve)."""
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1 and gqa_ok and key.shape[-1] == value.shape[-1] <= 256
    if groups > 1 and not gqa:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    # One split per tensor (not a slice per sequence): a slice's backward would zero-fill a
    # full-size gradient for every sequence, O(n_seqs * T) work; split's backward is one cat.
    qs, ks, vs = (t.split(lens, dim=2) for t in (query, key, value))
    return qs, ks, vs, ({"enable_gqa": True} if gqa else {})


def _per_sequence_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    dropout: float,
    scaling: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA on each [start, end) slice of the token dim; output [1, T, heads, head_dim]."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    n_tokens = query.shape[2]
    if bounds[0] != 0 or bounds[-1] != n_tokens or any(b > e for b, e in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seq_lens_q={bounds} must rise from 0 to the micro-batch's {n_tokens} tokens")
    lens = [e - s for s, e in zip(bounds, bounds[1:], strict=False)]
    qs, ks, vs, extra = _split_qkv(query, key, value, lens, attention_mask is None)
    outs = []
    for i, (s, e) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if e == s:  # an empty sequence contributes no tokens
            continue
        # A mask given here is the dense one plain sdpa would use; its diagonal block is this sequence's mask.
        mask = attention_mask[..., s:e, s:e] if attention_mask is not None else None
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qs[i],
                ks[i],
                vs[i],
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                is_causal=is_causal and mask is None and e - s > 1,
                **extra,
            )
        )
    # SDPA returns [1, heads, len, head_dim] views of [1, len, heads, head_dim] memory: join in that layout.
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1).contiguous()


def _prefix_shared_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_cu: torch.Tensor,
    block_prefix: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA on a prefix-shared row (see ``tandemrl.engines.prefix_sharing``); output [1, T, heads, head_dim].

    A block with ``block_prefix`` -1 attends causally to itself; a suffix block attends to all
    of its prefix block and causally to itself (one [len, P + len] mask per suffix).
    """
    bounds = [int(b) for b in block_cu.tolist()]
    parents = [int(p) for p in block_prefix.tolist()]
    if bounds[0] != 0 or bounds[-1] != query.shape[2] or len(parents) != len(bounds) - 1:
        raise ValueError(f"shared_block_cu={bounds} must rise from 0 to the row's {query.shape[2]} tokens")
    lens = [e - s for s, e in zip(bounds, bounds[1:], strict=False)]
    qs, ks, vs, extra = _split_qkv(query, key, value, lens, False)  # suffix blocks are masked
    outs = []
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k, v, mask, p = ks[b], vs[b], None, parents[b]
        if p >= 0:  # suffix: the whole prefix, then causal over its own tokens
            k, v = torch.cat([ks[p], k], dim=2), torch.cat([vs[p], v], dim=2)
            mask = torch.ones(n, lens[p] + n, dtype=torch.bool, device=query.device).tril(diagonal=lens[p])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        outs.append(
            sdpa(
                qs[b], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None and n > 1, **extra
            )
        )
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1).contiguous()


def varlen_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention function: per-sequence SDPA on a packed row, plain HF ``sdpa`` otherwise.

    q/k/v are [batch, heads, tokens, head_dim]; returns ([batch, tokens, heads, head_dim], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_k is not None and cu_seq_lens_q is not None and cu_seq_lens_k is not cu_seq_lens_q:
        if not torch.equal(cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu()):
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: varlen_sdpa supports self-attention only")
    n_q, n_k = query.shape[2], key.shape[2]
    block_cu, block_prefix = kwargs.pop("shared_block_cu", None), kwargs.pop("shared_block_prefix", None)
    if block_cu is not None and block_prefix is not None:
        if attention_mask is not None or n_q != n_k or query.shape[0] != 1:
            raise ValueError("shared_block_cu needs one packed row without attention mask or KV cache")
        return _prefix_shared_sdpa(query, key, value, block_cu, block_prefix, dropout, scaling), None
    cu = cu_seq_lens_q
    if cu is not None and query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q needs a packed batch of 1 row, got batch size {query.shape[0]}")
    if cu is None and attention_mask is None and query.shape[0] == 1 and n_q > 1 and n_q == n_k:
        cu = _boundaries_from_positions(kwargs.get("position_ids"), n_q)
    if cu is None or n_q != n_k:  # not packed, or a KV cache is in use: behave exactly like sdpa
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return _per_sequence_sdpa(query, key, value, attention_mask, cu, dropout, scaling, causal), None


def varlen_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """HF mask function: None for one unpadded full-attention row (packed or not), else sdpa's mask.

    None is safe there because the attention function then applies causality itself, per
    sequence. Sliding-window/chunked layers (``local_size``), custom mask overlays
    (``use_vmap``), padding masks and KV caches (``q_length != kv_length``) get sdpa's mask.
    """
    from transformers.masking_utils import sdpa_mask

    if batch_size == 1 and attention_mask is None and q_length == kv_length and local_size is None and not use_vmap:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        attention_mask=attention_mask,
        local_size=local_size,
        use_vmap=use_vmap,
        **kwargs,
    )


def register_varlen_attention() -> str:
    """Register ``varlen_sdpa`` with transformers (idempotent); returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)
    return VARLEN_SDPA
