"""What a backend can do is declared on its class (``features``) and read from the parsed allocation, never
decided by comparing a backend's name (docs/extending.md, "Features")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from utils import REPO_ROOT

from tandemrl.api.allocation import SERVER_FEATURES, TRAINING_FEATURES, AllocationMode
from tandemrl.configs import ConfigError, GRPOConfig
from tandemrl.configs.backends import BACKEND_TABLES, INFERENCE_ROWS, TRAINING_ROWS
from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.registry import register_engine
from tandemrl.inference.registry import backend_class
from tandemrl.trainers.entry import load_config

# A comparison with a built-in backend's name, either side: == "vllm", != 'fsdp', "megatron" == ...,
# in ("vllm", ...).
_NAMES = "vllm|sglang|fsdp|deepspeed|megatron"
NAME_COMPARISON = re.compile(
    rf"""(==|!=)\s*["']({_NAMES})["']|["']({_NAMES})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({_NAMES})["']"""
)
# The registries and the backends themselves may name themselves.
OWN = (
    "tandemrl/inference/registry.py",
    "tandemrl/engines/registry.py",
    "tandemrl/inference/vllm.py",
    "tandemrl/inference/vllm_ext.py",
    "tandemrl/inference/vllm_flags.py",
    "tandemrl/inference/sglang.py",
    "tandemrl/engines/fsdp.py",
    "tandemrl/engines/deepspeed.py",
    "tandemrl/engines/megatron/",
)


def _name_comparisons(files: dict[str, str]) -> list[str]:
    return [
        f"{path}:{n}: {line.strip()}"
        for path, text in files.items()
        if not path.startswith(OWN)
        for n, line in enumerate(text.splitlines(), 1)
        if NAME_COMPARISON.search(line)
    ]


def test_no_backend_name_comparison_outside_the_backends() -> None:
    files = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in (REPO_ROOT / "tandemrl").rglob("*.py")}
    assert _name_comparisons(files) == []


def test_the_grep_finds_the_forks_it_replaced() -> None:
    """The pattern is not vacuous: the three forms of comparison it forbids, as they were written before (commit
    a102b69: the launchers' token choice, the LoRA and router-replay checks)."""
    old = {
        "tandemrl/launchers/local.py": 'token = new_token() if any(c.backend == "vllm" for c in gens) else None',
        "tandemrl/configs/checks.py": 'if backend != "fsdp":\n    x = 1\nif "megatron" == backend: pass',
        "tandemrl/launchers/ray.py": 'if spec.gen_backend in ("vllm", "sglang"):',
        "tandemrl/inference/vllm.py": 'if self.name == "vllm":',  # a backend may name itself
    }
    assert len(_name_comparisons(old)) == 4
    show = ["git", "show", "a102b69:tandemrl/launchers/local.py"]
    before = subprocess.run(show, cwd=REPO_ROOT, capture_output=True, text=True)
    if before.returncode == 0:  # a clone with that commit: its local launcher had one
        assert len(_name_comparisons({"tandemrl/launchers/local.py": before.stdout})) == 1


@pytest.mark.parametrize("table", ["training", "inference"])
def test_declared_features_are_known_and_reach_the_parsed_components(table: str) -> None:
    rows, known = (TRAINING_ROWS, TRAINING_FEATURES) if table == "training" else (INFERENCE_ROWS, SERVER_FEATURES)
    shapes = BACKEND_TABLES[0] if table == "training" else BACKEND_TABLES[1]
    for name in rows:
        declared = shapes[name].features
        assert declared <= set(known), (name, declared - set(known))
    alloc = AllocationMode.from_str("vllm:d1+fsdp:d1", *BACKEND_TABLES)
    assert alloc.gen is not None and alloc.train is not None
    assert alloc.gen.features == backend_class("vllm").features >= {"token", "middleware", "lora_adapters"}
    assert alloc.train.features == FSDPEngine.features == {"lora", "fp32_head"}
    assert AllocationMode.from_str("sglang:d1+megatron:d1", *BACKEND_TABLES).train.features == {"router_replay"}
    assert AllocationMode.from_str("sglang:d1+megatron:d1", *BACKEND_TABLES).gen.features == frozenset()


@pytest.mark.parametrize("table", ["training", "inference"])
def test_the_registries_copies_match_what_the_classes_declare(table: str) -> None:
    """The registries answer built-in rows from their own copy (no import); each copy equals its class."""
    shapes = BACKEND_TABLES[0] if table == "training" else BACKEND_TABLES[1]
    for name in shapes:
        assert shapes[name] == shapes.declared(name), name


def test_registering_a_name_again_reads_the_new_class() -> None:
    old = TRAINING_ROWS["fsdp"]
    try:
        register_engine("fsdp", _PlainFSDP)
        assert BACKEND_TABLES[0]["fsdp"].features == frozenset()
    finally:
        register_engine("fsdp", old)
    assert BACKEND_TABLES[0]["fsdp"].features == {"lora", "fp32_head"}  # read from FSDPEngine now


class _PlainFSDP(FSDPEngine):
    """The FSDP engine under another name, declaring no features."""

    features = frozenset()


def test_a_check_follows_the_declaration_not_the_name(tmp_path: Path) -> None:
    """LoRA is accepted on an out-of-tree backend that declares it and refused, in one line, on one that does not."""
    grpo = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")
    lora = ["actor.engine.lora.rank=8"]
    try:
        register_engine("fsdplike", FSDPEngine)
        register_engine("plainfsdp", _PlainFSDP)
        cfg, _ = load_config(["--config", grpo, *lora, "allocation_mode=vllm:d1+fsdplike:d1"], GRPOConfig)
        assert cfg.actor.engine.lora.rank == 8
        with pytest.raises(ConfigError, match=r"actor\.engine\.lora\.rank.*trains with plainfsdp") as err:
            load_config(["--config", grpo, *lora, "allocation_mode=vllm:d1+plainfsdp:d1"], GRPOConfig)
        assert "\n" not in str(err.value)
    finally:
        TRAINING_ROWS.pop("fsdplike", None)
        TRAINING_ROWS.pop("plainfsdp", None)
