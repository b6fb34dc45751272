"""MegatronEngine (megatron-core on 2 gloo ranks): resume from a recoverable (megatron dist) checkpoint in
a fresh process on the same layout and resharded to TP=2 / PP=2, with and without the distributed
optimizer, updates independent of the micro-batch split, HF export that transformers reloads, stats
of the last pipeline stage on every stage, and MoE expert parallelism (EP=2 equals EP=1). Parity with
FSDP2 for DP/TP/PP lives in tests/integration/test_backend_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import assert_bf16_tracks_fp32, run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "megatron_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}
pytestmark = pytest.mark.slow  # two torchrun launches (train, resume): a few minutes


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tiny_moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    out = tmp_path_factory.mktemp("megatron")
    args = ["--model", tiny_model_dir, "--out", out]
    run_torchrun(WORKER, 2, ["train", *args, "--moe", tiny_moe_dir], env=ENV, timeout=600)
    run_torchrun(WORKER, 2, ["resume", *args, "--moe", tiny_moe_dir], env=ENV, timeout=400)
    return torch.load(out / "train.pt", weights_only=False), torch.load(out / "resume.pt", weights_only=False), out


def test_resume_in_a_fresh_process_gives_bit_identical_losses(runs: tuple[dict, dict, Path]) -> None:
    train, resume = runs[0], runs[1]["megatron:d2"]
    assert resume["version"] == 2
    assert all(torch.equal(resume["weights"][k], v) for k, v in train["saved_weights"].items())
    assert [s["lr"] for s in resume["continued"]] == [s["lr"] for s in train["continued"]]
    # Bit-identical: weights, Adam moments and step counts (sharded by the distributed optimizer)
    # and the LR schedule all come back; the 2nd and 3rd losses depend on the optimizer state.
    assert [s["loss"] for s in resume["continued"]] == [s["loss"] for s in train["continued"]]
    assert [s["grad_norm"] for s in resume["continued"]] == [s["grad_norm"] for s in train["continued"]]


def _assert_resumed(resume: dict, saved_weights: dict, continued: list[dict], version: int = 2) -> None:
    """Exact weights, version and LR schedule; the continued steps up to reduction order (rel 1e-5).
    Losing the Adam state changes the 2nd loss by ~1e-3 relative, far outside the tolerance."""
    assert resume["version"] == version
    assert sorted(resume["weights"]) == sorted(saved_weights)
    for name, saved in saved_weights.items():
        assert torch.equal(resume["weights"][name], saved), name
    assert [s["lr"] for s in resume["continued"]] == [s["lr"] for s in continued]
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in resume["continued"]] == pytest.approx([s[key] for s in continued], rel=1e-5), key


@pytest.mark.parametrize("allocation", ["megatron:t2", "megatron:p2"])
def test_resume_on_another_parallel_layout(runs: tuple[dict, dict, Path], allocation: str) -> None:
    """Saved at DP=2 with the distributed optimizer, loaded at TP=2 / PP=2 in a fresh process."""
    train, resume = runs[0], runs[1][allocation]
    _assert_resumed(resume, train["saved_weights"], train["continued"])


def test_bf16_model_resumes_bit_identically(runs: tuple[dict, dict, Path]) -> None:
    """bf16 weights with fp32 main params and Adam state in the distributed optimizer."""
    train, resume = runs[0], runs[1]["bf16"]
    assert [s["loss"] for s in resume["continued"]] == [s["loss"] for s in train["continued_bf16"]]
    assert [s["grad_norm"] for s in resume["continued"]] == [s["grad_norm"] for s in train["continued_bf16"]]
    assert resume["weights"]["model.norm.weight"].dtype == torch.bfloat16


def test_bf16_tracks_fp32_with_fp32_main_params(runs: tuple[dict, dict, Path]) -> None:
    """bf16 model parameters, fp32 main params and Adam state in the optimizer: 5 steps follow fp32."""
    precision = runs[0]["precision"]
    assert_bf16_tracks_fp32(precision["fp32"], precision["bf16"])
    assert precision["bf16"]["export_dtypes"] == ["bfloat16"]


def test_plain_optimizer_checkpoint_resumes_on_another_layout(runs: tuple[dict, dict, Path]) -> None:
    """use_distributed_optimizer=False: saved at DP=2, loaded at PP=2."""
    train, resume = runs[0], runs[1]["plain"]
    _assert_resumed(resume, train["saved_weights_plain"], train["continued_plain"])


def test_moe_checkpoint_resumes_with_another_expert_parallel_size(runs: tuple[dict, dict, Path]) -> None:
    """Saved at EP=2 (experts in their own chained optimizer), loaded at EP=1 (one optimizer)."""
    train, resume = runs[0], runs[1]["moe"]
    _assert_resumed(resume, train["saved_weights_moe"], train["moe"]["megatron:d2e2"][1:], version=1)


def test_checkpoint_before_the_first_step_resumes_on_another_layout(runs: tuple[dict, dict, Path]) -> None:
    """torch Adam has no state before its first step, megatron's state_dict needs one (DP=2 saves, TP=2 loads).
    The resumed engine replays the first two steps of the DP=2 run that started from the same weights."""
    train, resume = runs[0], runs[1]
    fresh = resume["fresh"]
    assert fresh["version"] == 0
    assert all(torch.equal(fresh["weights"][k], v) for k, v in resume["fresh_weights"].items())
    first_two = [train["split"][0], train["second"]]
    assert [s["lr"] for s in fresh["continued"]] == [s["lr"] for s in first_two]
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in fresh["continued"]] == pytest.approx([s[key] for s in first_two], rel=1e-5), key


def test_unloadable_checkpoint_is_one_clear_error(runs: tuple[dict, dict, Path]) -> None:
    err = runs[1]["broken_error"]
    assert "broken/dist_ckpt is not a complete megatron dist checkpoint" in err and "\n" not in err
    err = runs[1]["optimizer_kind_error"]
    assert "ckpt_plain holds non-distributed optimizer state" in err and "use_distributed_optimizer=False" in err


def test_update_does_not_depend_on_the_micro_batch_split(runs: tuple[dict, dict, Path]) -> None:
    one, three = runs[0]["split"]
    assert (one["n_mbs"], three["n_mbs"]) == (1.0, 3.0)
    assert three["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert three["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
    assert one["grad_norm"] > 1.0, "the pre-clip norm is reported (clipping at 1.0 is active)"


def test_hf_export_from_tensor_parallel_reloads_in_transformers(runs: tuple[dict, dict, Path]) -> None:
    from transformers import AutoModelForCausalLM

    train, _, out = runs
    assert [s.name for s in train["specs"]] == train["names"]
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    probe = train["probe"]
    mask = probe["attention_mask"].bool()
    with torch.no_grad():
        ref = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    got = train["logits"]
    assert got.shape == ref.shape
    assert (got[mask] - ref[mask]).abs().max().item() < 1e-4


def test_pipeline_first_stage_reports_the_loss_function_stats(runs: tuple[dict, dict, Path]) -> None:
    train = runs[0]
    stats, step = train["pp_stats"], train["pp_step"]  # rank 0 holds the first pipeline stage
    assert "sft/ppl_logp/avg" in stats and stats["sft/n_loss_tokens"] > 0, sorted(stats)
    assert stats["sft/loss"] == pytest.approx(step["loss"])
    # Evaluation through the forward-only schedule: the same loss the training step measured first.
    assert float(train["pp_eval"]) == pytest.approx(step["loss"], rel=1e-6)


def test_moe_expert_parallel_equals_single_expert_group(runs: tuple[dict, dict, Path]) -> None:
    moe = runs[0]["moe"]
    ep1, ep2 = moe["megatron:d2"], moe["megatron:d2e2"]
    losses = [s["loss"] for s in ep1]
    assert losses[-1] < losses[0], "the MoE model trains"
    assert [s["loss"] for s in ep2] == pytest.approx(losses, rel=1e-4)
    assert [s["grad_norm"] for s in ep2] == pytest.approx([s["grad_norm"] for s in ep1], rel=1e-4)
