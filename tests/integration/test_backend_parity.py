"""Cross-backend parity: the same 5 SFT steps and 3 PPO steps from the same HF weights and data
give the same losses and grad norms (fp32, 2 gloo ranks) on every training backend; so do 3
critic PPO steps (values, value loss, grad norm) of a critic from one HF critic checkpoint.

``CASES`` is the one table: a backend (or a layout of one) adds a row. ``allocation`` is the
training component's allocation_mode (it picks the engine class from the engine registry and
the parallel layout); ``overrides`` are dotted TrainEngineConfig fields. Rows with the same
``launch`` key (default: one shared launch) run in one torchrun launch; give a backend that
patches process-wide state (e.g. Megatron's CPU shims) its own key. The first row is the reference.
``critic_export`` rows also export their critic in HF format (checked against transformers below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from utils import run_torchrun

from tandemrl.configs.backends import parse_allocation

WORKER = Path(__file__).resolve().parents[1] / "workers" / "parity_checks.py"
ENV = {"TANDEMRL_DIST_TIMEOUT": "120"}
RTOL = 1e-4
pytestmark = pytest.mark.slow  # two torchrun launches: about 1-2 minutes

# Plain literals only: scripts/gpu_check.py reads this table with ast.literal_eval.
CASES: list[dict[str, Any]] = [
    {"name": "fsdp", "allocation": "fsdp:d2"},
    {"name": "deepspeed-zero1", "allocation": "deepspeed:d2", "overrides": {"deepspeed.zero_stage": 1}},
    {"name": "deepspeed-zero2", "allocation": "deepspeed:d2", "overrides": {"deepspeed.zero_stage": 2}},
    {"name": "deepspeed-zero3", "allocation": "deepspeed:d2", "overrides": {"deepspeed.zero_stage": 3}},
    # Megatron's CPU shims patch torch process-wide: its rows share a launch of their own.
    {"name": "megatron-d2", "allocation": "megatron:d2", "launch": "megatron"},
    {"name": "megatron-t2", "allocation": "megatron:t2", "launch": "megatron", "critic_export": True},
    {"name": "megatron-p2", "allocation": "megatron:p2", "launch": "megatron"},
    # A tiny Llama (SmolLM2's layout: tied embeddings, 2 query heads per KV head): its rows compare with its FSDP row.
    {"name": "fsdp-llama", "allocation": "fsdp:d2", "model": "llama"},
    {
        "name": "deepspeed-zero3-llama",
        "allocation": "deepspeed:d2",
        "overrides": {"deepspeed.zero_stage": 3},
        "model": "llama",
    },
    {"name": "megatron-t2-llama", "allocation": "megatron:t2", "launch": "megatron", "model": "llama"},
]
REFERENCE = CASES[0]["name"]
# The reference row of each model: the first row naming it (``model`` defaults to the tiny Qwen2).
REFERENCES = {m: next(c["name"] for c in CASES if c.get("model", "qwen2") == m) for m in ("qwen2", "llama")}
KEYS = (
    "sft_loss",
    "sft_grad_norm",
    "ppo_logp_sum",
    "ppo_loss",
    "ppo_grad_norm",
    "critic_values_sum",
    "critic_loss",
    "critic_grad_norm",
)


def _launches() -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by their ``launch`` key, in table order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for case in CASES:
        assert parse_allocation(case["allocation"]).train is not None, f"{case['name']}: no training component"
        groups.setdefault(case.get("launch", "shared"), []).append(case)
    return groups


@pytest.fixture(scope="module")
def results(
    tiny_model_dir: str, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, list[float]]]:
    out = tmp_path_factory.mktemp("parity")
    for cases in _launches().values():
        nproc = parse_allocation(cases[0]["allocation"]).train_world_size
        assert all(parse_allocation(c["allocation"]).train_world_size == nproc for c in cases)
        args = ["--cases", json.dumps(cases), "--model", tiny_model_dir, "--llama", tiny_llama_dir, "--out", out]
        run_torchrun(WORKER, nproc, args, env=ENV, timeout=600)
    return {c["name"]: torch.load(out / f"{c['name']}.pt") for c in CASES}


@pytest.mark.parametrize("name", REFERENCES.values())
def test_reference_trains(results: dict[str, dict[str, list[float]]], name: str) -> None:
    ref = results[name]
    assert len(ref["sft_loss"]) == 5 and len(ref["ppo_loss"]) == 3
    assert all(n > 0 for n in ref["sft_grad_norm"] + ref["ppo_grad_norm"])
    assert len(set(ref["ppo_loss"])) == 3
    assert len(ref["critic_loss"]) == 3 and all(n > 0 for n in ref["critic_grad_norm"])
    assert len(set(ref["critic_values_sum"])) == 3  # the updates change the values


@pytest.mark.parametrize("case", [c for c in CASES if c["name"] not in REFERENCES.values()], ids=lambda c: c["name"])
def test_backend_matches_reference(results: dict[str, dict[str, list[float]]], case: dict[str, Any]) -> None:
    name, reference = case["name"], REFERENCES[case.get("model", "qwen2")]
    ref, got = results[reference], results[name]
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=RTOL), f"{name} {key}: {got[key]} vs {reference} {ref[key]}"


EXPORT_ROWS = [c["name"] for c in CASES if c.get("critic_export")]


def _hf_critic(path: str) -> torch.nn.Module:
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", EXPORT_ROWS)
def test_exported_critic_reloads_in_hf(results: dict[str, dict[str, Any]], name: str) -> None:
    """The trained critic's HF export, reloaded by transformers, gives the engine's values on a probe batch."""
    exp = results[name]["critic_export"]
    model = _hf_critic(exp["trained"])
    assert model.config.num_labels == 1
    probe, got = exp["probe"], exp["probe_values"]
    lens = probe["attention_mask"].sum(1).tolist()
    with torch.no_grad():
        want = [model(input_ids=probe["input_ids"][i : i + 1, :n]).logits[0, :, 0] for i, n in enumerate(lens)]
    for i, n in enumerate(lens):
        torch.testing.assert_close(got[i, :n], want[i], rtol=RTOL, atol=RTOL * float(want[i].abs().max()))
        assert not got[i, n:].any(), f"row {i}: values on padding"


@pytest.mark.parametrize("name", EXPORT_ROWS)
def test_critic_from_causal_lm_matches_hf_init(
    results: dict[str, dict[str, Any]], tiny_model_dir: str, name: str
) -> None:
    """A critic built from a causal-LM checkpoint is HF's: same backbone, lm_head dropped, and the value head
    initialised exactly as ``from_pretrained`` does after the engine's seed."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    exp = results[name]["critic_export"]
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(exp["seed"])
    want = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=config, dtype=torch.float32)
    want = want.state_dict()
    got = _hf_critic(exp["from_lm"]).state_dict()
    assert sorted(got) == sorted(want) and "score.weight" in got
    for k, v in want.items():
        assert torch.equal(got[k], v), k
