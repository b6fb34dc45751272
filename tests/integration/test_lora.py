"""LoRA: only adapters train, merged exports equal base + (alpha/r) B A, FSDP2 on 2 ranks, adapter
updates to a real LoRA-enabled vLLM server (docs/lora.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from utils import REPO_ROOT, run_torchrun
from vllm_server import VLLMTestServer, hf_greedy, launch_test_server, load_hf

from tandemrl.api.inference import WeightUpdateMeta
from tandemrl.configs import GRPOConfig
from tandemrl.configs.engine import LORA_DEFAULT_TARGETS, LoRAConfig
from tandemrl.configs.loader import ConfigError
from tandemrl.engines.lora import (
    LoRALinear,
    adapter_items,
    apply_lora,
    merge_adapter_dir,
    merged_items,
    read_adapter,
    write_adapter,
)
from tandemrl.inference.vllm import ADAPTER_NAME, VLLMBackend
from tandemrl.trainers.entry import load_script_config

WORKERS = Path(__file__).resolve().parents[1] / "workers"
ENV = {"TANDEMRL_DIST_TIMEOUT": "300"}
LORA = LoRAConfig(rank=4, alpha=8.0)


def _tokens(vocab: int, seed: int, shape: tuple[int, int] = (4, 16)) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _trained_lora_model(model_dir: str, steps: int = 2) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with adapters after ``steps`` AdamW steps, and its weights before them."""
    model = load_hf(model_dir)
    apply_lora(model, LORA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        ids = _tokens(model.config.vocab_size, seed=step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, before


def test_only_adapters_change_and_the_start_equals_the_base(tiny_model_dir: str) -> None:
    base = load_hf(tiny_model_dir)
    ids = _tokens(base.config.vocab_size, seed=9)
    model, before = _trained_lora_model(tiny_model_dir)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == len(LORA_DEFAULT_TARGETS) * base.config.num_hidden_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = model.state_dict()
    for name, t in after.items():
        if ".lora_" in name:
            assert not torch.equal(t, before[name]), f"{name} did not train"
        else:
            assert torch.equal(t, before[name]), f"frozen {name} changed"
    # B starts at zero: a freshly wrapped model computes exactly what the base does.
    fresh = load_hf(tiny_model_dir)
    apply_lora(fresh, LORA)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, base(input_ids=ids).logits)


def test_merged_export_is_base_plus_scaled_product(tiny_model_dir: str, tmp_path: Path) -> None:
    model, _ = _trained_lora_model(tiny_model_dir)
    sd = model.state_dict()
    merged = dict(merged_items(sd, LORA.alpha / LORA.rank))
    base_sd = load_hf(tiny_model_dir).state_dict()
    assert merged.keys() == base_sd.keys()
    n_adapted = 0
    for name, w in merged.items():
        stem = name.removesuffix(".weight")
        if stem + ".lora_A.weight" in sd:
            a, b = sd[stem + ".lora_A.weight"].double(), sd[stem + ".lora_B.weight"].double()
            expected = base_sd[name].double() + (LORA.alpha / LORA.rank) * b @ a
            torch.testing.assert_close(w.double(), expected, rtol=0, atol=1e-6)
            assert not torch.equal(w, base_sd[name])
            n_adapted += 1
        else:
            assert torch.equal(w, base_sd[name]), name
    assert n_adapted == len(LORA_DEFAULT_TARGETS) * model.config.num_hidden_layers
    # The adapter directory (PEFT names) merged onto the base directory: the same model for transformers.
    write_adapter(str(tmp_path / "adapter"), dict(adapter_items(sd)), LORA, tiny_model_dir)
    config, tensors = read_adapter(str(tmp_path / "adapter"))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(LORA_DEFAULT_TARGETS)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()  # noqa: SIM118
    assert all(torch.equal(t, sd[k]) for k, t in tensors.items())
    merge_adapter_dir(tiny_model_dir, str(tmp_path / "adapter"), str(tmp_path / "merged"))
    reloaded = load_hf(str(tmp_path / "merged"))
    ids = _tokens(model.config.vocab_size, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_bad_lora_configs_fail_with_one_line(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"lora\.target_modules: none of \['nope'\]"):
        apply_lora(load_hf(tiny_model_dir), LoRAConfig(rank=4, target_modules=["nope"]))
    grpo = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")
    for overrides, expected in [
        (["actor.engine.lora.rank=8", "allocation_mode=vllm:d1+deepspeed:d1"], "LoRA is FSDP2-only for now"),
        (["actor.engine.lora.rank=-1"], ">= 0"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_script_config(["--config", grpo, *overrides], GRPOConfig)
        assert "actor.engine.lora.rank" in str(err.value) and expected in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    overrides = ["actor.engine.lora.rank=8", "actor.engine.lora.target_modules=[q_proj]"]
    lora = load_script_config(["--config", grpo, *overrides], GRPOConfig)[0].actor.engine.lora
    assert (lora.rank, lora.target_modules) == (8, ["q_proj"])


def test_vllm_backend_adapter_requests() -> None:
    b = VLLMBackend()
    meta = WeightUpdateMeta(type="disk", path="/ckpt/adapter", version=3)
    load, flush, label = b.build_load_adapter(meta)
    assert (load.method, load.path) == ("POST", "/v1/load_lora_adapter")
    assert load.json == {"lora_name": ADAPTER_NAME, "lora_path": "/ckpt/adapter", "load_inplace": True}
    assert (flush.path, label.json) == ("/reset_prefix_cache", {"new_version": "3"})
    info = {
        "vllm_config": {"lora_config": {"max_lora_rank": 16}},
        "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
    }
    assert b.parse_lora_probe(info) == 16
    assert b.parse_lora_probe({**info, "vllm_env": {}}) == 0  # no runtime loading route
    assert b.parse_lora_probe({"vllm_config": {"lora_config": None}, "vllm_env": info["vllm_env"]}) == 0
    from tandemrl.api.inference import ModelRequest

    req = ModelRequest(input_ids=[5, 6])
    assert "model" not in b.build_generate(req, [], 4, 0).json
    b.adapter_loaded()
    assert b.build_generate(req, [], 4, 0).json["model"] == ADAPTER_NAME


def test_lora_serve_decides_adapter_or_merged_pushes() -> None:
    """auto: the adapter alone on GPUs, merged weights on CPU (vLLM's CPU LoRA path is the slow one);
    adapter: required of the servers; merged: never asks them."""
    from tandemrl.weights.push import adapter_fits, wants_adapter

    assert [wants_adapter(8, "auto", d) for d in ("cuda", "cpu")] == [True, False]
    assert [wants_adapter(8, "adapter", d) for d in ("cuda", "cpu")] == [True, True]
    assert [wants_adapter(8, "merged", d) for d in ("cuda", "cpu")] == [False, False]
    assert not wants_adapter(0, "adapter", "cuda")  # no LoRA: nothing to choose
    with pytest.raises(ValueError, match=r"^lora\.serve: unknown value 'both'"):
        wants_adapter(8, "both", "cuda")
    assert adapter_fits(8, "auto", 8) and adapter_fits(8, "adapter", 16)
    assert not adapter_fits(8, "auto", 0)  # servers without LoRA get merged weights
    with pytest.raises(ValueError, match=r"^lora\.serve=adapter, but the inference servers load no adapters"):
        adapter_fits(8, "adapter", 0)
    with pytest.raises(ValueError, match=r"^lora\.rank=32 exceeds the inference servers' max LoRA rank 16"):
        adapter_fits(32, "auto", 16)


def test_launcher_starts_lora_servers_for_disk_updates() -> None:
    from tandemrl.launchers.launch_config import read_launch_spec
    from tandemrl.launchers.placement import visible_gpus

    grpo = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")
    adapter = ["actor.engine.lora.serve=adapter"]
    spec = read_launch_spec(grpo, ["actor.engine.lora.rank=12", "weight_update_mode=disk", *adapter])
    assert spec.server_extra == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1}
    # auto: adapters only where the servers get GPUs; a CPU run pushes merged weights.
    auto = read_launch_spec(grpo, ["actor.engine.lora.rank=12", "weight_update_mode=disk"]).server_extra
    assert auto == (spec.server_extra if visible_gpus() else {})
    merged = ["actor.engine.lora.rank=12", "weight_update_mode=disk", "actor.engine.lora.serve=merged"]
    assert read_launch_spec(grpo, merged).server_extra == {}
    # Collective updates send merged weights: the servers need no LoRA support.
    assert read_launch_spec(grpo, ["actor.engine.lora.rank=12", "weight_update_mode=collective"]).server_extra == {}
    assert read_launch_spec(grpo, ["weight_update_mode=disk"]).server_extra == {}
    with pytest.raises(ValueError, match=r"lora\.rank=600 exceeds"):
        read_launch_spec(grpo, ["actor.engine.lora.rank=600", "weight_update_mode=disk", *adapter])


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_fsdp2_two_ranks_bf16_train_only_adapters_and_export_merged(tiny_model_dir: str, tmp_path: Path) -> None:
    run_torchrun(WORKERS / "lora_checks.py", 2, ["--model", tiny_model_dir, "--out", tmp_path], env=ENV)
    res = torch.load(tmp_path / "lora.pt")
    assert res["world"] == 2 and res["trainable"]
    assert all(".lora_A." in n or ".lora_B." in n for n in res["trainable"])
    before, after = res["before"], res["after"]
    for name in after:
        if ".lora_" in name:
            assert not torch.equal(after[name], before[name]), f"{name} did not train"
        else:
            assert torch.equal(after[name], before[name]), f"frozen {name} changed"
    scaling = 8.0 / 4
    merged_dir = load_hf(str(tmp_path / "merged")).state_dict()
    for name, t in res["exported"].items():  # the collective path's tensors
        stem = name.removesuffix(".weight")
        if stem + ".lora_A.weight" in after:
            a, b = after[stem + ".lora_A.weight"].double(), after[stem + ".lora_B.weight"].double()
            torch.testing.assert_close(t.double(), after[name].double() + scaling * b @ a, rtol=0, atol=1e-6)
        else:
            assert torch.equal(t, after[name])
        assert torch.equal(merged_dir[name], t), f"HF export of {name} differs from iter_hf_params"
    _, adapter = read_adapter(str(tmp_path / "adapter"))
    assert adapter.keys() == {n for n in after if ".lora_" in n}
    assert all(torch.equal(t, after[k]) for k, t in adapter.items())
    # The engine's bf16 forward and transformers on the merged export agree (bf16 compute vs fp32).
    probe, logits = res["probe"], res["logits"]
    hf = load_hf(str(tmp_path / "merged"))
    with torch.no_grad():
        n = int(probe["attention_mask"][0].sum())
        ref = hf(input_ids=probe["input_ids"][:1, :n]).logits[0]
    assert (logits[0, :n] - ref).abs().max().item() < 0.1
    # DCP resume: adapters and their Adam states come back (the next step lands on the same weights).
    assert all(torch.equal(res["restored"][k], t) for k, t in after.items())
    assert all(torch.equal(res["resumed_stepped"][k], t) for k, t in res["stepped"].items())


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["disk", "collective"])
def test_server_without_lora_gets_merged_weights(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path, sync: str
) -> None:
    """The session server loads no adapters: a LoRA trainer's disk and collective pushes send the merged
    model, and the server then generates as transformers does on the merged export."""
    from test_weight_sync import check_update_record, random_prompts, run_worker
    from vllm_server import restore_session_server, weight_label

    label = weight_label(vllm_server)
    prompts = random_prompts(int(load_hf(tiny_model_dir).config.vocab_size), seed=17, n=256)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    try:
        run_worker(
            "update", tiny_model_dir, vllm_server, tmp_path, "--sync", sync, "--lora-rank", "8",
            "--prompts", str(tmp_path / "prompts.json"), "--lr", "3e-3",
        )  # fmt: skip
        assert not check_update_record(tmp_path, prompts, sync, fp32_server=False)["sync"]["adapter"]
    finally:
        restore_session_server(vllm_server, label)


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMTestServer]:
    """A vLLM server with runtime LoRA loading, for this module only."""
    log = tmp_path_factory.mktemp("vllm-lora") / "server.log"
    start = time.monotonic()
    proc = launch_test_server(tiny_model_dir, str(log), enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        proc.wait_healthy(900.0)
        yield VLLMTestServer(proc, tiny_model_dir, time.monotonic() - start)
    finally:
        proc.stop()


@pytest.mark.slow
def test_adapter_update_reaches_vllm_and_matches_merged_weights(
    lora_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    """FSDP2 LoRA trainer -> disk push: the pusher sends only the adapter, the server's greedy output
    changes and then equals transformers' on the merged export; versions advance on both sides."""
    vocab = int(load_hf(tiny_model_dir).config.vocab_size)
    prompts = torch.randint(3, vocab, (256, 8), generator=torch.Generator().manual_seed(3)).tolist()
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    args = ["update", "--model", tiny_model_dir, "--addr", lora_server.proc.address, "--out", str(tmp_path)]
    args += ["--sync", "disk", "--prompts", str(tmp_path / "prompts.json"), "--lr", "3e-3", "--lora-rank", "8"]
    args += ["--lora-serve", "adapter"]  # a CPU run would push merged weights (lora.serve: auto)
    run_torchrun(WORKERS / "sync_checks.py", 2, args, env=ENV, timeout=600)
    record = torch.load(tmp_path / "update.pt")
    sync = record["sync"]
    n_full = sum(p.numel() * p.element_size() for p in load_hf(str(tmp_path / "exported")).parameters())
    print(f"\nadapter update: {sync}, full model {n_full} bytes, losses {record['losses']}")
    assert sync["adapter"] and 0 < sync["bytes"] < n_full / 4
    assert record["losses"][-1] < record["losses"][0]
    before, after = record["before"], record["after"]
    refs = hf_greedy(load_hf(str(tmp_path / "exported")), prompts, len(after[0]))
    # bf16 server: compare the prompts whose greedy paths have the widest top-2 logit gaps.
    compared = sorted(range(len(prompts)), key=lambda i: refs[i].min_gap, reverse=True)[:8]
    for i in compared:
        assert after[i] == refs[i].ids, f"prompt {i}: server {after[i]} != merged HF {refs[i].ids}"
    assert len({tuple(refs[i].ids) for i in compared}) >= len(compared) // 2  # not one collapsed output
    changed = sum(b != a for b, a in zip(before, after, strict=True))
    assert changed >= len(prompts) // 2, f"the adapter changed only {changed}/{len(prompts)} greedy outputs"
    assert record["label_after"] == "1" and record["client_version"] == 1
    assert record["rank_versions"] == [(1, 1)] * 2


def test_a_full_fine_tuning_learning_rate_on_lora_gets_one_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tandemrl.configs.experiment import GRPOConfig
    from tandemrl.trainers.entry import load_script_config

    grpo = ["--config", str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml"), "actor.engine.lora.rank=8"]
    load_script_config([*grpo, "actor.engine.optimizer.lr=5e-5"], GRPOConfig)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "warning: actor.engine.optimizer.lr=5e-05 is a full fine-tuning learning rate, but actor.engine.lora.rank=8: "
        "LoRA learned here at 10x the full-weight rate (5e-4 vs 5e-5, alpha 32, ranks 1 to 32; docs/lora.md)"
    ]
    load_script_config([*grpo, "actor.engine.optimizer.lr=5e-4"], GRPOConfig)  # LoRA's range: quiet
    load_script_config([*grpo[:2], "actor.engine.optimizer.lr=5e-5"], GRPOConfig)  # full weights: quiet
    assert capsys.readouterr().err == ""
