"""MegatronEngine MoE on 2 gloo ranks (one torchrun launch, tests/workers/megatron_moe_checks.py):
the load-balancing aux loss weighted like the main loss whatever the micro-batching, pipeline or sequence
parallelism, and logged; expert tensor parallelism via the hybrid allocation; MoE under TP (sequence
parallel on the local spec)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from utils import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "megatron_moe_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}
AUX_COEF = 0.01
REL = 1e-5


def aux_model(src: str, dst: Path) -> Path:
    """The tiny MoE with HF's router aux loss switched on (so model.py turns on megatron's aux_loss)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def runs(tiny_moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("megatron_moe")
    aux = aux_model(tiny_moe_dir, out / "aux_moe")
    args = ["--moe", tiny_moe_dir, "--aux-moe", aux, "--out", out]
    run_torchrun(WORKER, 2, args, env=ENV, timeout=900)
    res = torch.load(out / "moe.pt", weights_only=False)
    res["aux_dir"] = aux
    return res


def _losses(run: dict) -> list[float]:
    return [s["loss"] for s in run["steps"]]


def _norms(run: dict) -> list[float]:
    return [s["grad_norm"] for s in run["steps"]]


def _aux(run: dict) -> list[float]:
    return [s["exported"]["sft/moe/aux_loss"] for s in run["steps"]]


@pytest.mark.slow
def test_aux_loss_weighting_is_split_and_layout_invariant(runs: dict) -> None:
    rep = runs["aux_repeated"]
    ref = rep["d2_mbs1"]
    assert _losses(ref)[-1] < _losses(ref)[0], "the MoE model trains"
    for name in ("d2_mbs2", "p2_mbs2", "t2_mbs2"):
        assert _losses(rep[name]) == pytest.approx(_losses(ref), rel=REL), name
        assert _norms(rep[name]) == pytest.approx(_norms(ref), rel=REL), name
        assert _aux(rep[name]) == pytest.approx(_aux(ref), rel=REL), name
    # Distinct micro-batches (distinct weights and aux losses): pipeline schedule vs plain loop.
    even = runs["aux_even"]
    assert _losses(even["p2_mbs2"]) == pytest.approx(_losses(even["t2_mbs2"]), rel=REL)
    assert _norms(even["p2_mbs2"]) == pytest.approx(_norms(even["t2_mbs2"]), rel=REL)
    assert _aux(even["p2_mbs2"]) == pytest.approx(_aux(even["t2_mbs2"]), rel=REL)


@pytest.mark.slow
def test_logged_aux_loss_is_the_switch_loss_of_the_hf_router(runs: dict) -> None:
    """Step 1's moe/aux_loss (before any update) recomputed from the HF model's router logits:
    per MoE layer E / (k N^2) * sum_e tokens_e * sum_tokens softmax_e, times the coefficient, summed."""
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(WORKER.parent))
    from megatron_moe_checks import SEEDS, repeated_batch

    model = AutoModelForCausalLM.from_pretrained(runs["aux_dir"], dtype=torch.float32)
    cfg = model.config
    batch = repeated_batch(SEEDS[0])
    logits_per_layer: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        for i in range(2):  # a and b: every micro-batch holds them in equal numbers
            n = int(batch["attention_mask"][i].sum())
            out = model(input_ids=batch["input_ids"][i : i + 1, :n], output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                logits_per_layer[layer].append(logits.reshape(-1, cfg.num_experts).float())
    k, n_exp = cfg.num_experts_per_tok, cfg.num_experts
    want = 0.0
    for chunks in logits_per_layer:
        logits = torch.cat(chunks)
        probs = torch.softmax(logits, -1)
        counts = torch.zeros(n_exp).index_add_(
            0, logits.topk(k, -1).indices.flatten(), torch.ones(logits.numel() // n_exp * k)
        )
        n = logits.shape[0]
        want += AUX_COEF * n_exp / (k * n * n) * float((counts * probs.sum(0)).sum())
    got = _aux(runs["aux_repeated"]["d2_mbs1"])[0]
    assert got == pytest.approx(want, rel=1e-4)
    assert AUX_COEF * cfg.num_hidden_layers * 0.5 < got < AUX_COEF * cfg.num_hidden_layers * n_exp


@pytest.mark.slow
def test_expert_tensor_parallel_hybrid_equals_data_parallel(runs: dict) -> None:
    d2, hybrid = runs["etp"]["d2"], runs["etp"]["hybrid"]
    assert _losses(hybrid) == pytest.approx(_losses(d2), rel=1e-4)
    assert _norms(hybrid) == pytest.approx(_norms(d2), rel=1e-4)
    _assert_same_export(d2["hf"], hybrid["hf"])


@pytest.mark.slow
def test_moe_under_tensor_parallel_equals_data_parallel(runs: dict) -> None:
    lengths = [n for step in runs["tp_mb_lengths"] for n in step]
    assert any(n % 2 for n in lengths), f"no micro-batch needs padding to a multiple of tp: {lengths}"
    d2 = runs["tp"]["d2"]
    for name in ("t2", "t2|e2"):  # experts replicated over TP / split by EP
        got = runs["tp"][name]
        assert _losses(got) == pytest.approx(_losses(d2), rel=1e-4), name
        assert _norms(got) == pytest.approx(_norms(d2), rel=1e-4), name
        _assert_same_export(d2["hf"], got["hf"])


def _assert_same_export(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Same names, shapes and (after 3 Adam steps of 1e-3) weights. Adam's first steps move near-zero-gradient
    entries (rarely seen embedding rows) by up to lr on fp noise, hence a max bound well under lr and a
    tight mean."""
    assert list(got) == list(ref)
    total = diff_sum = 0.0
    for name, t in ref.items():
        assert got[name].shape == t.shape, name
        diff = (got[name] - t).abs()
        assert diff.max().item() < 3e-4, name
        diff_sum += diff.sum().item()
        total += t.numel()
    assert diff_sum / total < 1e-7
