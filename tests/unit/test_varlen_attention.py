"""varlen_sdpa: packed logits/grads equal per-sequence sdpa, fallbacks equal sdpa, exports stay standard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandemrl.models.varlen_attention import VARLEN_SDPA, register_varlen_attention, varlen_sdpa_mask

VOCAB = 97
LENS = [7, 1, 19, 0, 12, 3]  # mixed lengths, including single-token and empty sequences


def _config(attn: str, **extra: object) -> object:
    """A fresh tiny Qwen2 config (GQA: 4 query heads over 2 KV heads); fresh because HF mutates it."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation=attn,
        **extra,
    )


def _pair(dtype: torch.dtype = torch.float32, **extra: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random weights under sdpa (reference) and varlen_sdpa."""
    from transformers import AutoModelForCausalLM

    register_varlen_attention()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config("sdpa", **extra), dtype=dtype)
    varlen = AutoModelForCausalLM.from_config(_config(VARLEN_SDPA, **extra), dtype=dtype)
    varlen.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa"
    assert varlen.config._attn_implementation == VARLEN_SDPA
    return ref, varlen


def _packed(lens: list[int], seed: int = 0) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    inputs = {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
    }
    return seqs, {**inputs, "cu": cu}


def _varlen_kwargs(cu: torch.Tensor) -> dict[str, torch.Tensor | int]:
    m = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}


def _per_sequence_logits(model: torch.nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(input_ids=s[None]).logits[0] for s in seqs if len(s)])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _weights(n_tokens: int) -> torch.Tensor:
    """Fixed per-token, per-vocab weights so the test loss gives every logit a distinct gradient."""
    return torch.randn(n_tokens, VOCAB, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_logits_and_grads_match_per_sequence_sdpa(checkpointing: bool) -> None:
    ref, varlen = _pair()
    if checkpointing:
        varlen.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.train(), varlen.train()  # attention dropout is 0; train mode is what checkpointing needs
    seqs, p = _packed(LENS)
    w = _weights(sum(LENS))

    out = varlen(input_ids=p["input_ids"], position_ids=p["position_ids"], **_varlen_kwargs(p["cu"])).logits[0]
    expected = _per_sequence_logits(ref, seqs)
    assert (out - expected).abs().max().item() < 1e-5
    (out * w).sum().backward()
    (expected * w).sum().backward()
    g_var, g_ref = _grads(varlen), _grads(ref)
    assert g_var.keys() == g_ref.keys() and len(g_var) > 0
    for name in g_ref:
        scale = g_ref[name].abs().max().item()
        assert (g_var[name] - g_ref[name]).abs().max().item() <= 1e-5 * max(1.0, scale), name


def test_position_ids_alone_give_the_sequence_boundaries() -> None:
    """Without cu_seq_lens_*, restarts of position_ids split the row (still no cross-sequence attention)."""
    ref, varlen = _pair()
    seqs, p = _packed(LENS, seed=3)
    with torch.no_grad():
        out = varlen(input_ids=p["input_ids"], position_ids=p["position_ids"]).logits[0]
        expected = _per_sequence_logits(ref, seqs)
    assert (out - expected).abs().max().item() < 1e-5


def test_packed_forward_never_builds_a_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.masking_utils as mu

    def no_dense_mask(**kwargs: object) -> None:
        raise AssertionError("a dense attention mask was built for a packed row")

    _, varlen = _pair()
    _, p = _packed([300, 200, 250])
    monkeypatch.setattr(mu, "sdpa_mask", no_dense_mask)
    with torch.no_grad():
        varlen(input_ids=p["input_ids"], position_ids=p["position_ids"], **_varlen_kwargs(p["cu"]))
    assert varlen_sdpa_mask(batch_size=1, q_length=750, kv_length=750) is None
    with pytest.raises(AssertionError, match="dense attention mask"):  # a padded batch still gets sdpa's mask
        varlen_sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=torch.ones(2, 5, dtype=torch.bool))


def test_padded_batches_and_generation_behave_like_sdpa() -> None:
    ref, varlen = _pair()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    am = torch.ones(3, 10, dtype=torch.long)
    am[0, 6:] = 0  # right padding
    am[2, :4] = 0  # left padding, as in batched generation: real tokens must not see it
    with torch.no_grad():
        a = varlen(input_ids=ids, attention_mask=am).logits
        b = ref(input_ids=ids, attention_mask=am).logits
    keep = am.bool()
    assert (a[keep] - b[keep]).abs().max().item() < 1e-5
    # Greedy decoding with a KV cache (prefill, then one query token per step).
    gen = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    prompt, prompt_mask = ids[1:, :8], am[1:, :8]
    out_var = varlen.generate(prompt, attention_mask=prompt_mask, **gen)
    out_ref = ref.generate(prompt, attention_mask=prompt_mask, **gen)
    assert out_var.shape[1] > prompt.shape[1]
    assert torch.equal(out_var, out_ref)


def test_sliding_window_layers_stay_within_their_window() -> None:
    """Sliding-window layers get sdpa's (packed) mask; each sequence uses its diagonal block."""
    extra = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    ref, varlen = _pair(**extra)
    assert "sliding_attention" in varlen.config.layer_types
    seqs, p = _packed([9, 3, 11], seed=7)
    with torch.no_grad():
        out = varlen(input_ids=p["input_ids"], position_ids=p["position_ids"], **_varlen_kwargs(p["cu"])).logits[0]
        expected = _per_sequence_logits(ref, seqs)
    assert (out - expected).abs().max().item() < 1e-5


def test_bf16_forward_and_backward_stay_close() -> None:
    ref, varlen = _pair(torch.bfloat16)
    seqs, p = _packed(LENS, seed=11)
    out = varlen(input_ids=p["input_ids"], position_ids=p["position_ids"], **_varlen_kwargs(p["cu"])).logits[0]
    expected = _per_sequence_logits(ref, seqs)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max().item() < 2e-2
    out.float().sum().backward()
    grads = _grads(varlen)
    assert len(grads) > 0 and all(torch.isfinite(g).all() for g in grads.values())


def test_bad_boundaries_are_rejected_clearly() -> None:
    _, varlen = _pair()
    _, p = _packed(LENS)
    base = {"input_ids": p["input_ids"], "position_ids": p["position_ids"]}
    short = p["cu"].clone()
    short[-1] -= 1
    with torch.no_grad():
        with pytest.raises(ValueError, match="cu_seq_lens_q="):
            varlen(**base, **_varlen_kwargs(short))
        with pytest.raises(ValueError, match="batch size 2"):
            varlen(input_ids=p["input_ids"].repeat(2, 1), **_varlen_kwargs(p["cu"]))
        other = p["cu"].clone()
        other[1] += 1
        with pytest.raises(ValueError, match="cu_seq_lens_k"):
            varlen(**base, cu_seq_lens_q=p["cu"], cu_seq_lens_k=other)


def test_export_keeps_a_standard_attention_config(tmp_path: Path) -> None:
    """Like the engine's _save_hf: a model built from a varlen config saves a config other tools can load."""
    from transformers import AutoModelForCausalLM

    from tandemrl.configs.engine import TrainEngineConfig

    assert TrainEngineConfig().attn_impl == VARLEN_SDPA  # the engine default
    ref, varlen = _pair()
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(varlen.config)
    assert fresh.config._attn_implementation == VARLEN_SDPA
    fresh.save_pretrained(tmp_path, state_dict=varlen.state_dict())
    saved = (tmp_path / "config.json").read_text()
    assert VARLEN_SDPA not in saved and "attn_implementation" not in json.loads(saved)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config._attn_implementation == "sdpa"
    seqs, _ = _packed([6, 11], seed=13)
    with torch.no_grad():
        assert torch.equal(_per_sequence_logits(loaded, seqs), _per_sequence_logits(ref.eval(), seqs))
