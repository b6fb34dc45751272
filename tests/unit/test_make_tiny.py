"""Tiny HF model builder: loadable by transformers, consistent special tokens, deterministic, cached."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tandemrl.models import load_hf_config, load_hf_tokenizer
from tandemrl.models import make_tiny as mt

# Small but valid settings for tests that build their own models (builds take ~1-2 s).
SMALL = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=300)


def _gsm8k_rows(gsm8k_dir: str, split: str, n: int) -> list[dict[str, str]]:
    with open(Path(gsm8k_dir) / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def test_tiny_model_loads_and_runs_forward_backward(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 2 and cfg.hidden_size == 128
    assert model.dtype == torch.float32
    assert cfg.vocab_size % mt.VOCAB_MULTIPLE == 0 and cfg.vocab_size >= len(tok)
    assert not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()

    ids = torch.tensor([tok.encode("Natalia sold 48/2 = <<48/2=24>>24 clips in May.")])
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_tokenizer_is_trained_on_gsm8k_and_round_trips(tiny_model_dir: str, gsm8k_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))
    assert 900 <= len(tok) <= 1024  # ~--vocab merges were learned from the corpus
    chars = tokens = 0
    for row in _gsm8k_rows(gsm8k_dir, "test", 100):
        text = row["question"] + "\n" + row["answer"]
        ids = tok.encode(text, add_special_tokens=False)
        # AutoTokenizer (which rebuilds a Qwen2 pipeline) and tokenizer.json alone must agree.
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        chars, tokens = chars + len(text), tokens + len(ids)
    assert chars / tokens > 2.0  # BPE merges actually compress GSM8K text


def test_chat_template_renders_qwen_style(tiny_model_dir: str) -> None:
    tok = load_hf_tokenizer(tiny_model_dir)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    with_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert with_prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    without = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    convo = msgs + [{"role": "assistant", "content": "5"}]
    rendered = tok.apply_chat_template(convo, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n5<|im_end|>\n")
    ids = tok(with_prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == with_prompt
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # special tokens are never split
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


def test_special_token_ids_agree_across_tokenizer_config_generation_config(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    assert cfg.eos_token_id == gen.eos_token_id == tok.eos_token_id
    assert cfg.pad_token_id == gen.pad_token_id == tok.pad_token_id
    for special in mt.SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_builds_are_deterministic(tmp_path: Path) -> None:
    a = mt.make_tiny_model(tmp_path / "a", **SMALL, seed=3)
    b = mt.make_tiny_model(tmp_path / "b", **SMALL, seed=3)
    c = mt.make_tiny_model(tmp_path / "c", **SMALL, seed=4)
    wa, wb, wc = (load_file(str(Path(d) / "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys() and len(wa) > 0
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)  # the seed matters
    assert (Path(a) / "tokenizer.json").read_bytes() == (Path(b) / "tokenizer.json").read_bytes()


def test_builtin_corpus_needs_no_files(tmp_path: Path) -> None:
    path = mt.make_tiny_model(tmp_path / "m", **SMALL)
    tok = AutoTokenizer.from_pretrained(path)
    text = "Tina buys 12 boxes of pencils. Each box holds 6 pencils.\n#### 72"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)


def test_qwen3_moe_builds_and_runs(tiny_moe_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob and cfg.decoder_sparse_step == 1 and cfg.vocab_size % mt.VOCAB_MULTIPLE == 0
    assert cfg.eos_token_id == tok.eos_token_id
    keys = load_file(str(Path(tiny_moe_dir) / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys  # per-expert (vLLM/Megatron) layout
    ids = torch.tensor([tok.encode("Betty has 15 dollars and needs 100.")])
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(out.loss)
    out.loss.backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_llama_ties_its_embeddings_through_save_and_reload(tiny_llama_dir: str, tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    tok, qwen_tok = AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Betty has 15 dollars and needs 100."
    assert tok.encode(text) == qwen_tok.encode(text)  # the same tokenizer, whatever model_type says


def test_ensure_tiny_model_builds_once_and_keys_by_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = mt.ensure_tiny_model(tmp_path, **SMALL)
    assert (Path(first) / "model.safetensors").is_file()

    def fail(*a: object, **k: object) -> str:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(mt, "make_tiny_model", fail)
    assert mt.ensure_tiny_model(tmp_path, **SMALL) == first
    other_key = mt.tiny_model_key("qwen2", **{**SMALL, "seed": 1})
    assert other_key != Path(first).name
    # MoE-only arguments do not change a dense model's key.
    assert mt.tiny_model_key("qwen2", **{**SMALL, "experts": 8}) == Path(first).name
    assert [p.name for p in tmp_path.iterdir()] == [Path(first).name]  # no temp dirs left behind


def test_ensure_tiny_model_concurrent_callers_share_one_dir(tmp_path: Path) -> None:
    results: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(mt.ensure_tiny_model(tmp_path, **SMALL, seed=7))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0]).name]
    AutoModelForCausalLM.from_pretrained(results[0])  # the surviving copy is complete


def test_cli_writes_requested_shape(tmp_path: Path) -> None:
    mt.main(
        ["--out", str(tmp_path / "cli"), "--arch", "qwen3_moe", "--hidden", "64", "--heads", "2"]
        + ["--kv-heads", "1", "--layers", "1", "--experts", "3", "--top-k", "1", "--vocab", "300"]
    )
    cfg = load_hf_config(str(tmp_path / "cli"))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (64, 2, 1)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (3, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden": 30, "heads": 4}, "hidden=30 must be divisible by heads=4"),
        ({"heads": 4, "kv_heads": 3}, "heads=4 must be divisible by kv_heads=3"),
        ({"vocab": 100}, "vocab=100 is too small"),
        ({"layers": 0}, "layers=0 must be a positive int"),
    ],
)
def test_bad_arguments_raise_clear_errors(tmp_path: Path, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mt.make_tiny_model(tmp_path / "x", **kwargs)


def test_unknown_arch_and_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        mt.make_tiny_model(tmp_path / "x", "gpt2")
    with pytest.raises(FileNotFoundError, match="nope"):
        mt.make_tiny_model(tmp_path / "x", corpus_path=str(tmp_path / "nope"))


def test_hf_loaders_name_missing_local_paths(tmp_path: Path, tiny_model_dir: str) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_config(missing)
    assert load_hf_config(tiny_model_dir).model_type == "qwen2"
    tok = load_hf_tokenizer(tiny_model_dir)
    assert tok.is_fast and tok.pad_token_id is not None
