"""MegatronEngine (megatron-core on 2 gloo ranks): resume from a recoverable checkpoint in a fresh
process, updates independent of the micro-batch split, HF export that transformers reloads, stats
of the last pipeline stage on every stage, and MoE expert parallelism (EP=2 equals EP=1). Parity with FSDP2 for DP/TP/PP lives in
tests/test_backend_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import run_torchrun

WORKER = Path(__file__).parent / "workers" / "megatron_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tiny_moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    out = tmp_path_factory.mktemp("megatron")
    args = ["--model", tiny_model_dir, "--out", out]
    run_torchrun(WORKER, 2, ["train", *args, "--moe", tiny_moe_dir], env=ENV, timeout=600)
    run_torchrun(WORKER, 2, ["resume", *args], env=ENV, timeout=400)
    return torch.load(out / "train.pt", weights_only=False), torch.load(out / "resume.pt", weights_only=False), out


def test_resume_in_a_fresh_process_gives_bit_identical_losses(runs: tuple[dict, dict, Path]) -> None:
    train, resume, _ = runs
    assert resume["version"] == 2
    assert [s["lr"] for s in resume["continued"]] == [s["lr"] for s in train["continued"]]
    # Bit-identical: weights, Adam moments and step counts (sharded by the distributed optimizer)
    # and the LR schedule all come back; the 2nd and 3rd losses depend on the optimizer state.
    assert [s["loss"] for s in resume["continued"]] == [s["loss"] for s in train["continued"]]
    assert [s["grad_norm"] for s in resume["continued"]] == [s["grad_norm"] for s in train["continued"]]


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
