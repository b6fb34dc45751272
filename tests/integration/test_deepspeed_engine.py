"""DeepSpeedEngine (ZeRO 1/2/3, 2 gloo ranks): updates equal plain torch on the union of the ranks'
data whatever the micro-batch split, HF export/import, weight iteration for updates, resume in a
fresh process, NaN guard, bf16; plus the DeepSpeed config merge (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from utils import assert_bf16_tracks_fp32, assert_prefix_sharing_exact, run_torchrun

from tandemrl.configs.engine import DeepSpeedEngineConfig, OptimizerConfig, TrainEngineConfig
from tandemrl.engines.deepspeed import deepspeed_config

WORKER = Path(__file__).resolve().parents[1] / "workers" / "deepspeed_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    out = tmp_path_factory.mktemp("deepspeed")
    run_torchrun(WORKER, 2, ["train", "--model", tiny_model_dir, "--out", out], env=ENV, timeout=400)
    run_torchrun(WORKER, 2, ["resume", "--model", tiny_model_dir, "--out", out], env=ENV, timeout=400)
    return torch.load(out / "train.pt", weights_only=False), torch.load(out / "resume.pt", weights_only=False), out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reference(model_dir: str, batches: list[dict], lrs: list[float]) -> tuple[list, list, dict]:
    """Plain single-process torch: token-mean next-token NLL over the whole global batch, clip 1.0, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.0)
    losses, norms = [], []
    for batch, lr in zip(batches, lrs, strict=True):
        num, den = torch.zeros(()), 0
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            ids = batch["input_ids"][i, :n]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), -1)
            mask = batch["loss_mask"][i, 1:n].bool()
            num = num - logp.gather(-1, ids[1:, None]).squeeze(-1)[mask].sum()
            den += int(mask.sum())
        loss = num / den
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", STAGES)
def test_update_equals_plain_torch_whatever_the_micro_batch_split(
    runs: tuple[dict, dict, Path], tiny_model_dir: str, stage: int
) -> None:
    train, _, _ = runs
    res = train[stage]
    lrs = [s["lr"] for s in res["first"]]
    assert lrs[1] < lrs[0], "the linear schedule must decay the lr"
    losses, norms, params = _reference(tiny_model_dir, train["batches"], lrs)
    assert [s["n_mbs"] for s in res["first"]] != [1.0, 1.0], "splits must include several micro-batches"
    assert [s["loss"] for s in res["first"]] == pytest.approx(losses, rel=1e-5)
    assert [s["grad_norm"] for s in res["first"]] == pytest.approx(norms, rel=1e-5)
    assert norms[0] > 1.0, "the pre-clip norm is reported (clipping at 1.0 is active)"
    assert _max_diff(res["params"], params) < 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_hf_export_reloads_with_identical_weights_and_logits(runs: tuple[dict, dict, Path], stage: int) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, _, out = runs
    res = train[stage]
    hf_dir = out / f"z{stage}" / "hf"
    saved = load_file(hf_dir / "model.safetensors")
    engine_sd = {k: v for k, v in res["params"].items() if k in saved}
    assert set(res["params"]) - set(saved) <= {"lm_head.weight"}, "only the tied head may be dropped"
    assert _bitwise_equal(saved, engine_sd)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.use_cache is True
    probe, logits = res["probe"], res["logits"]
    lens = probe["attention_mask"].sum(1).tolist()
    assert len(set(lens)) > 1
    with torch.no_grad():
        for i, n in enumerate(lens):
            ref = hf(input_ids=probe["input_ids"][i : i + 1, :n]).logits[0]
            assert (logits[i, :n] - ref).abs().max().item() < 1e-5
    assert AutoTokenizer.from_pretrained(hf_dir).eos_token_id == hf.config.eos_token_id


@pytest.mark.parametrize("stage", STAGES)
def test_iter_hf_params_gives_full_weights_on_every_rank(runs: tuple[dict, dict, Path], stage: int) -> None:
    train, _, out = runs
    full = train[stage]["params"]
    for rank in (0, 1):
        got = torch.load(out / f"z{stage}" / f"iter_rank{rank}.pt", weights_only=False)
        specs, params = got["specs"], got["params"]
        assert [s.name for s in specs] == [n for n, _ in params] == list(full)
        for spec, (name, t) in zip(specs, params, strict=True):
            assert spec.shape == tuple(t.shape) and spec.dtype == str(t.dtype).removeprefix("torch."), name
            assert torch.equal(t.cpu(), full[name]), f"rank {rank} {name}"


@pytest.mark.parametrize("stage", STAGES)
def test_resume_in_a_fresh_process_is_bit_identical(runs: tuple[dict, dict, Path], stage: int) -> None:
    train, resume, _ = runs
    assert resume[stage]["version"] == 2
    assert resume[stage]["lr"] == pytest.approx(1e-4 * (1 - 2 / 10))  # the linear schedule after 2 of 10 steps
    assert resume[stage]["continued"] == train[stage]["continued"]


@pytest.mark.parametrize("stage", STAGES)
def test_hf_load_sets_weights_and_the_optimizer_master_copy(runs: tuple[dict, dict, Path], stage: int) -> None:
    from safetensors.torch import load_file

    train, resume, out = runs
    res = resume[stage]
    saved = load_file(out / f"z{res['loaded_from']}" / "hf" / "model.safetensors")
    after = res["after_load"]
    assert saved.keys() == after.keys() and _bitwise_equal(saved, after)
    assert _max_diff(res["before_load"], after) > 1e-5, "the load must move this engine's weights"


@pytest.mark.parametrize("stage", STAGES)
def test_nan_gradient_skips_the_step(runs: tuple[dict, dict, Path], stage: int) -> None:
    nan = runs[0][stage]["nan"]
    assert nan["stats"]["update_successful"] == 0.0
    assert not torch.isfinite(torch.tensor(nan["stats"]["grad_norm"]))
    assert _bitwise_equal(nan["before"], nan["after"])
    assert nan["next"]["update_successful"] == 1.0 and torch.isfinite(torch.tensor(nan["next"]["loss"]))


def test_bf16_tracks_fp32_with_fp32_master_weights(runs: tuple[dict, dict, Path]) -> None:
    """ZeRO-1 and ZeRO-3 (with gradient checkpointing) in bf16 follow the fp32 losses over 5 steps."""
    res = runs[0]["bf16"]
    for tag in ("bf16_z1", "bf16_z3"):
        assert_bf16_tracks_fp32(res["fp32"], res[tag])
        assert res[tag]["export_dtypes"] == ["bfloat16"], tag  # DeepSpeed's module holds the bf16 copy


def test_reference_engines_and_critic(runs: tuple[dict, dict, Path], tiny_model_dir: str) -> None:
    """Forward-only engines (ZeRO-1 runs unsharded, ZeRO-3 partitioned) give HF's logprobs; a ZeRO-3 critic fits."""
    from transformers import AutoModelForCausalLM

    others = runs[0]["others"]
    batch = others["batch"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            ids = batch["input_ids"][i, :n]
            ref = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            for stage, logp in others["ref_logp"].items():
                assert (logp[i, : n - 1] - ref).abs().max().item() < 1e-5, stage
    losses = others["critic_losses"]
    assert losses[0] > losses[1] > losses[2], losses


def test_prefix_sharing_gives_the_unshared_update(runs: tuple[dict, dict, Path]) -> None:
    """ZeRO-3, 2 ranks, fp32: a GRPO update (G=4, completions of different lengths) with the group-shared
    prompt prefix gives the unshared layout's logprobs, loss and gradients."""
    assert_prefix_sharing_exact(runs[0]["prefix"])


# ------------------------------------------------------------------ config merge (no processes)
def _cfg(**ds: object) -> TrainEngineConfig:
    return TrainEngineConfig(
        path="unused", optimizer=OptimizerConfig(gradient_clipping=0.5), deepspeed=DeepSpeedEngineConfig(**ds)
    )


def test_user_config_is_merged_under_what_the_engine_owns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    user = {
        "train_batch_size": 64,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 3.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "allgather_bucket_size": 12345},
        "wall_clock_breakdown": True,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = _cfg(zero_stage=2, config_path=str(path), extra={"zero_optimization": {"overlap_comm": True}})
    with caplog.at_level("WARNING"):
        ds = deepspeed_config(cfg, dp_world_size=4)
    assert ds["zero_optimization"] == {"stage": 2, "allgather_bucket_size": 12345, "overlap_comm": True}
    assert ds["gradient_clipping"] == 0.5 and ds["train_batch_size"] == 4
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert ds["managed_gradient_accumulation"] is False
    assert ds["bf16"] == {"enabled": True} and "optimizer" not in ds and ds["wall_clock_breakdown"] is True
    warned = caplog.text
    for key in ("train_batch_size", "gradient_clipping", "optimizer", "zero_optimization.stage"):
        assert key in warned, key


def test_precision_offload_and_forward_only_mapping() -> None:
    cfg = _cfg(zero_stage=3, offload_optimizer=True, offload_params=True)
    assert cfg.mixed_precision == "bfloat16"  # the default: bf16 compute, fp32 accumulation and reduction
    ds = deepspeed_config(cfg, 2)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["communication_data_type"] == "fp32" and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    cfg.deepspeed.extra = {"communication_data_type": "bf16"}  # a user's choice wins
    assert deepspeed_config(cfg, 2)["communication_data_type"] == "bf16"
    cfg.mixed_precision = None
    fp32 = deepspeed_config(cfg, 2)
    assert not fp32["bf16"]["enabled"] and "data_types" not in fp32
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False
    stage1 = deepspeed_config(_cfg(zero_stage=1, extra={"zero_optimization": {"overlap_comm": True}}), 2)
    assert stage1["zero_optimization"]["overlap_comm"] is False  # needs stage >= 2 with manual boundaries
    ref = _cfg(zero_stage=2)
    ref.optimizer = None
    assert deepspeed_config(ref, 2)["zero_optimization"]["stage"] == 0  # nothing to shard without an optimizer
    assert deepspeed_config(ref, 2)["gradient_clipping"] == 0.0


def test_bad_deepspeed_options_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="deepspeed.offload_params"):
        deepspeed_config(_cfg(zero_stage=2, offload_params=True), 2)
    with pytest.raises(ValueError, match="deepspeed.zero_stage"):
        deepspeed_config(_cfg(zero_stage=0), 2)
    with pytest.raises(FileNotFoundError, match="deepspeed.config_path"):
        deepspeed_config(_cfg(config_path=str(tmp_path / "missing.json")), 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="deepspeed.config_path: .*bad.json is not valid JSON"):
        deepspeed_config(_cfg(config_path=str(bad)), 2)


def test_registry_rows() -> None:
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.deepspeed import DeepSpeedEngine
    from tandemrl.engines.registry import engine_class, make_engine

    # One row for the backend (the algorithms run on the engine it builds in tests/workers/deepspeed_checks.py).
    assert engine_class("deepspeed") is DeepSpeedEngine
    assert type(make_engine("deepspeed", TrainEngineConfig(path="unused"))) is DeepSpeedEngine
