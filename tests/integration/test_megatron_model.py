"""Megatron model half: HF config/weights -> GPTModel (TP/PP/EP) -> logits and HF export, against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from utils import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "megatron_model_checks.py"
LAYOUTS = (
    "dense_tp1",
    "dense_tp2",
    "dense_pp2",
    "moe_ep1",
    "moe_ep2",
    "moe_pp2",
    "qwen3_tp2",
    "qwen3_pp2",
    "variant_pp2",
    "variant_ep2",
    "llama_tp2",
    "llama_pp2",
)


def make_variant(out: Path, arch: str) -> str:
    """Models unlike the tiny fixtures: tied embeddings, odd vocab, trained-looking norms (!= 1); for qwen3_moe
    also a dense layer among MoE ones and unnormalised top-k probabilities; llama is SmolLM2's layout in small
    (3 query heads per KV head, no biases, rope theta 1e5)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=1021,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_theta=5000.0,
    )
    if arch == "qwen3":
        cfg = Qwen3Config(**common)
    elif arch == "llama":
        llama = {"hidden_size": 96, "num_attention_heads": 6, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
        cfg = LlamaConfig(**{**common, **llama})
    else:
        cfg = Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def results(tiny_model_dir: str, tiny_moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ONE torchrun launch (2 gloo ranks) running every layout; ~1.5 min."""
    out = tmp_path_factory.mktemp("megatron-model")
    variant, qwen3 = make_variant(out / "variant", "qwen3_moe"), make_variant(out / "qwen3", "qwen3")
    llama = make_variant(out / "llama", "llama")
    args = ["--dense", tiny_model_dir, "--moe", tiny_moe_dir, "--variant", variant, "--qwen3", qwen3, "--out", out]
    args += ["--llama", llama]
    args += ["--only", *LAYOUTS]
    run_torchrun(WORKER, 2, args, timeout=900)
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_logits_match_transformers(results: dict, layout: str) -> None:
    r = results[layout]
    assert r["logit_max_diff"], "no rank produced logits"
    assert max(r["logit_max_diff"]) < 1e-4, r
    assert r["logit_scale"] > 0.1  # the comparison is not between near-zero tensors


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_gradient_through_gathered_logits_matches_transformers(results: dict, layout: str) -> None:
    """gather_vocab_logits' backward must not sum the TP ranks' identical losses (that would give TP x grad)."""
    r = results[layout]
    assert r["norm_grad_rel_diff"] and max(r["norm_grad_rel_diff"]) < 1e-4, r


@pytest.mark.slow
def test_block_mask_is_what_keeps_packed_sequences_apart(results: dict) -> None:
    assert results["dense_tp1"]["plain_mask_diff"] > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_is_bit_identical_and_reloads(results: dict, layout: str) -> None:
    r = results[layout]
    assert r["missing"] == [] and r["extra"] == [], r
    assert r["not_equal_export"] == [], r
    assert r["not_equal_reload"] == [], r
    assert r["same_on_all_ranks"], "ranks saw different exported tensors"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_param_specs_match_exported_tensors(results: dict, layout: str) -> None:
    assert results[layout]["specs_match"]


@pytest.mark.slow
def test_bf16_export_is_the_checkpoint_in_bf16(results: dict) -> None:
    r = results["bf16_export"]
    assert r["n"] > 0 and r["not_equal"] == [], r
    assert r["dtypes"] == ["torch.bfloat16"] and r["specs_match"], r
    assert r["param_dtypes"] == ["torch.bfloat16"], "every parameter (norms too) in the model dtype, as in HF"


@pytest.mark.slow
def test_moe_scaling_example_trains_with_expert_parallelism(tiny_moe_dir: str, gsm8k_dir: str) -> None:
    """examples/moe_scaling/train_moe.py, EP=2: experts split over the 2 ranks and the loss goes down."""
    from utils import REPO_ROOT

    script = REPO_ROOT / "examples" / "moe_scaling" / "train_moe.py"
    args = ["--model", tiny_moe_dir, "--ep", "2", "--steps", "6", "--seq-len", "64", "--data", "gsm8k"]
    args += ["--gsm8k", gsm8k_dir]
    proc = run_torchrun(script, 2, args, timeout=600)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert (r["ep"], r["dp"]) == (2, 2)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_moe_dir)
    expert = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    full = sum(t.numel() for t in _checkpoint(tiny_moe_dir).values())
    assert r["params_per_rank"] == [full - expert // 2] * 2  # each rank holds half of the experts
    assert r["loss_last"] < r["loss_first"]


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.slow
def test_loading_another_architecture_fails_naming_tensors(results: dict) -> None:
    msg = results["strict_load_error"]
    assert "missing" in msg and "model.layers.0.mlp.gate_proj.weight" in msg
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msg


def test_packed_causal_mask_blocks_and_padding() -> None:
    from tandemrl.engines.megatron.forward import packed_causal_mask, packed_position_ids

    mask = packed_causal_mask(torch.tensor([0, 2, 5]), 6, "cpu")
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    allowed = ~mask[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 2), (2, 5), (5, 6)):  # the trailing pad token is its own block
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(allowed, expected)
    assert packed_position_ids(torch.tensor([0, 2, 5]), 6, "cpu").tolist() == [[0, 1, 0, 1, 2, 0]]
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_causal_mask(torch.tensor([1, 3]), 4, "cpu")
    with pytest.raises(ValueError, match="total_len"):
        packed_causal_mask(torch.tensor([0, 9]), 4, "cpu")


def test_thd_packed_seq_params_match_the_mask_blocks() -> None:
    """The TransformerEngine path (GPU) sees the same sequence blocks as the local spec's mask."""
    from tandemrl.engines.megatron.forward import packed_seq_params

    p = packed_seq_params(torch.tensor([0, 2, 5]), 6, "cpu")
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 2, 5, 6] and p.cu_seqlens_q.dtype == torch.int32  # pad: own block
    assert p.max_seqlen_q == 3 and p.max_seqlen_kv == 3
    assert packed_seq_params(torch.tensor([0, 4]), 4, "cpu").cu_seqlens_kv.tolist() == [0, 4]


def test_padded_vocab_size() -> None:
    from tandemrl.engines.megatron.model import padded_vocab_size

    assert [padded_vocab_size(v, 2) for v in (373, 374)] == [374, 374]
    assert padded_vocab_size(1021, 4) == 1024 and padded_vocab_size(7, 1) == 7


def test_param_specs_cover_the_checkpoint(tiny_moe_dir: str) -> None:
    """Names and shapes equal the safetensors file (order: the export order), without building a model."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from tandemrl.engines.megatron.hf_convert import hf_param_specs

    specs = hf_param_specs(AutoConfig.from_pretrained(tiny_moe_dir), dtype=torch.bfloat16)
    with safe_open(str(Path(tiny_moe_dir) / "model.safetensors"), framework="pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {s.name: s.shape for s in specs} == on_disk
    assert len(specs) == len(on_disk) and {s.dtype for s in specs} == {"bfloat16"}
    assert specs[0].name == "model.embed_tokens.weight" and specs[-1].name == "lm_head.weight"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ({"use_sliding_window": True}, "sliding_window"),
    ],
)
def test_unsupported_configs_fail_clearly(tiny_model_dir: str, change: dict, field: str) -> None:
    from transformers import AutoConfig

    from tandemrl.engines.megatron.model import transformer_config_from_hf

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=field):
        transformer_config_from_hf(cfg, tp=1, pp=1, ep=1, params_dtype=torch.float32)


def test_moe_with_tensor_parallelism_turns_on_sequence_parallelism(tiny_moe_dir: str, tiny_model_dir: str) -> None:
    """megatron-core trains MoE layers under TP only with sequence parallelism (dense models keep it off)."""
    from transformers import AutoConfig

    from tandemrl.engines.megatron.model import transformer_config_from_hf

    def sp(path: str) -> bool:
        cfg = AutoConfig.from_pretrained(path)
        return transformer_config_from_hf(cfg, tp=2, pp=1, ep=1, params_dtype=torch.float32).sequence_parallel

    assert sp(tiny_moe_dir) and not sp(tiny_model_dir)


def test_dense_model_rejects_expert_parallelism(tiny_model_dir: str) -> None:
    from transformers import AutoConfig

    from tandemrl.engines.megatron.model import transformer_config_from_hf

    with pytest.raises(ValueError, match="ep=2"):
        transformer_config_from_hf(
            AutoConfig.from_pretrained(tiny_model_dir), tp=1, pp=1, ep=2, params_dtype=torch.float32
        )
