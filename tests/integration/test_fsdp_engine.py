"""FSDPEngine: packing correctness, micro-batch/DP invariance, HF export, DCP resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import assert_bf16_tracks_fp32, assert_prefix_sharing_exact, run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "fsdp_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def invariance_results(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("invariance")
    for nproc in (1, 2):
        run_torchrun(WORKER, nproc, ["invariance", "--model", tiny_model_dir, "--out", out], env=ENV)
    return {n: torch.load(out / f"invariance_w{n}.pt") for n in (1, 2)}


def test_micro_batch_count_does_not_change_the_update(invariance_results: dict[int, dict]) -> None:
    one = invariance_results[1]
    ref = one["mb1"]
    for tag in ("mb4", "tok48"):
        assert one[tag]["n_mbs"] > 1
        assert _max_diff(one[tag]["params"], ref["params"]) < 1e-5
        assert one[tag]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        assert one[tag]["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_two_ranks_match_one_rank_on_the_same_global_batch(invariance_results: dict[int, dict]) -> None:
    ref = invariance_results[1]["mb1"]
    for tag, res in invariance_results[2].items():
        assert _max_diff(res["params"], ref["params"]) < 1e-5, tag
        assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), tag
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5), tag


def test_packed_forward_matches_separate_sequences(tiny_model_dir: str, tmp_path: Path) -> None:
    """Engine logits of a packed batch equal each sequence run alone through HF (fp32)."""
    from transformers import AutoModelForCausalLM

    run_torchrun(
        WORKER,
        2,
        ["checkpoint", "--model", tiny_model_dir, "--tokenizer", tiny_model_dir, "--out", tmp_path],
        env=ENV,
    )
    res = torch.load(tmp_path / "continued.pt")
    probe, logits = res["probe"], res["logits"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    lens = probe["attention_mask"].sum(1).tolist()
    assert len(set(lens)) > 1, "probe must mix lengths to exercise packing"
    with torch.no_grad():
        for i, n in enumerate(lens):
            ref = hf(input_ids=probe["input_ids"][i : i + 1, :n]).logits[0]
            assert (logits[i, :n] - ref).abs().max().item() < 1e-5
    # The exported directory is a complete HF checkpoint with the tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token_id == hf.config.eos_token_id

    run_torchrun(WORKER, 2, ["resume", "--model", tiny_model_dir, "--out", tmp_path], env=ENV)
    resumed = torch.load(tmp_path / "resumed.pt")["losses"]
    assert resumed == res["losses"], "DCP resume must replay the next three losses bit-identically"


def test_checkpointing_mixed_precision_nan_guard_and_prefix_sharing(tiny_model_dir: str, tmp_path: Path) -> None:
    run_torchrun(WORKER, 2, ["variants", "--model", tiny_model_dir, "--out", tmp_path], env=ENV)
    res = torch.load(tmp_path / "variants.pt")
    plain, ckpt = res["plain"], res["ckpt"]
    # Recomputing activations changes nothing numerically in fp32.
    assert ckpt["stats"]["loss"] == pytest.approx(plain["stats"]["loss"], rel=1e-6)
    assert _max_diff(ckpt["params"], plain["params"]) < 1e-6
    # bf16 compute tracks fp32 over 5 steps; master weights (exported as they are) stay fp32.
    precision = res["precision"]
    assert_bf16_tracks_fp32(precision["fp32"], precision["bf16"])
    assert precision["bf16"]["export_dtypes"] == ["float32"]
    # A NaN gradient skips the step on every rank and is reported.
    nan = res["nan"]
    assert nan["stats"]["update_successful"] == 0.0
    assert _max_diff(nan["after"], nan["before"]) == 0.0
    assert any("optimizer step skipped: gradient norm nan is not finite" in w for w in res["warned"]), res["warned"]
    # A batch with no trainable token is skipped with a warning and a count, the weights unchanged.
    empty = res["empty"]
    assert empty["stats"]["update_successful"] == 0.0 and empty["exported"]["skipped_empty"] == 1.0
    assert _max_diff(empty["after"], nan["before"]) == 0.0
    assert any("update skipped, no trainable token" in w for w in res["warned"]), res["warned"]
    # A GRPO update (G=4, completions of different lengths) with the group-shared prompt prefix
    # gives the unshared layout's logprobs, loss and gradients.
    assert_prefix_sharing_exact(res["prefix"])


def test_precision_is_one_knob_with_clear_errors() -> None:
    from tandemrl.configs.engine import TrainEngineConfig
    from tandemrl.engines.precision import resolve_precision

    default = resolve_precision(TrainEngineConfig())
    assert (default.weights, default.compute, default.mixed) == (torch.float32, torch.bfloat16, True)
    fp32 = resolve_precision(TrainEngineConfig(mixed_precision=None))
    assert (fp32.compute, fp32.mixed) == (torch.float32, False)
    pure = resolve_precision(TrainEngineConfig(dtype="bfloat16"))  # bf16 weights computing in bf16
    assert (pure.weights, pure.mixed) == (torch.bfloat16, False)
    with pytest.raises(ValueError, match=r"mixed_precision=float16 needs dtype=float32 .*got dtype=bfloat16"):
        resolve_precision(TrainEngineConfig(dtype="bfloat16", mixed_precision="float16"))
    with pytest.raises(ValueError, match="TrainEngineConfig.mixed_precision: unknown dtype 'bf16'"):
        resolve_precision(TrainEngineConfig(mixed_precision="bf16"))
