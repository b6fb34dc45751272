"""Forward helpers for packed (padding-free) batches on Megatron's GPTModel."""

from __future__ import annotations

from typing import Any

import torch


def packed_causal_mask(cu_seqlens: torch.Tensor, total_len: int, device: Any) -> torch.Tensor:
    """[1, 1, T, T] bool mask, True = masked out: causal within each packed sequence, nothing across.

    Lets b=1 bshd packing work with the local (non-TE) attention, which has no thd/varlen path.
    Positions past cu_seqlens[-1] (padding) form their own causal block so they never leak into real tokens.
    """
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be a 1-D non-decreasing tensor starting at 0, got {cu.tolist()}")
    if int(cu[-1]) > total_len:
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} exceeds total_len={total_len}")
    lengths = torch.diff(torch.cat([cu, torch.tensor([total_len])]))
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)
    pos = torch.arange(total_len, device=device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def packed_position_ids(cu_seqlens: torch.Tensor, total_len: int, device: Any) -> torch.Tensor:
    """[1, T] positions restarting at 0 for every packed sequence (and for trailing padding)."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    lengths = torch.diff(torch.cat([cu, torch.tensor([total_len])]))
    starts = torch.repeat_interleave(torch.cat([cu, torch.tensor([total_len])])[:-1], lengths)
    return (torch.arange(total_len) - starts).to(device)[None]


def packed_seq_params(cu_seqlens: torch.Tensor, total_len: int, device: Any) -> Any:
    """thd PackedSeqParams for the TransformerEngine spec (GPU only: the local spec asserts on thd).

    Needed there because TE's causal attention ignores ``attention_mask``; pass ``attention_mask=None``.
    Trailing padding past cu_seqlens[-1] becomes one more sequence, as in ``packed_causal_mask``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device="cpu", dtype=torch.int32)
    if int(cu[-1]) < total_len:
        cu = torch.cat([cu, torch.tensor([total_len], dtype=torch.int32)])
    cu = cu.to(device)
    longest = int(torch.diff(cu).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def gather_vocab_logits(logits_parallel: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits from TP vocab shards (differentiable), padded rows sliced off.

    Megatron's gather, whose backward keeps this rank's slice of the gradient: every TP rank computes the
    same loss on the gathered logits, so a summing backward (torch.distributed.nn's all_gather) would
    scale the gradient by TP.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() > 1:
        logits_parallel = gather_from_tensor_model_parallel_region(logits_parallel.contiguous())
    return logits_parallel[..., :vocab_size]
