"""The algorithm's engine contract (``tandemrl.api.engine.TrainEngine``) holds what the algorithms use, no more.

Every public member of ``TrainEngine`` is read by some algorithm in tandemrl/algorithms (through an ``engine``
or ``self.engine`` attribute), the lifecycle and weight export live on ``TrainBackend``, and no algorithm probes
an engine with ``getattr``/``hasattr``: an optional capability (``router_replay``) is a flag of the contract.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from utils import REPO_ROOT

from tandemrl.api.engine import TrainBackend, TrainEngine
from tandemrl.engines.base import BaseTrainEngine

ALGORITHMS = REPO_ROOT / "tandemrl" / "algorithms"


def _members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def engine_reads(root: Path) -> set[str]:
    """Names read as ``engine.<name>`` or ``<x>.engine.<name>`` in the modules under ``root``."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"
            ):
                names.add(node.attr)
    return names


def attribute_probes(root: Path) -> list[str]:
    """``path:line`` of each getattr/hasattr call in the modules under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return found


def test_engine_reads_finds_engine_attributes(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("engine.forward(b)\nself.engine.train()\nother.device\nself.engine_x.eval()\n")
    assert engine_reads(tmp_path) == {"forward", "train"}


def test_every_member_of_the_contract_is_used_by_an_algorithm() -> None:
    unused = _members(TrainEngine) - engine_reads(ALGORITHMS)
    assert not unused, f"TrainEngine members no algorithm reads (move them to TrainBackend): {sorted(unused)}"


def test_the_backend_adds_lifecycle_and_weight_export() -> None:
    assert issubclass(TrainBackend, TrainEngine) and issubclass(BaseTrainEngine, TrainBackend)
    assert _members(TrainBackend) == {
        "moe_hybrid",  # with parallel_dims (a bare annotation): the allocation_mode shapes it declares
        "features",  # what it can do beyond this interface (api.allocation.TRAINING_FEATURES)
        "create_process_group",
        "initialize",
        "destroy",
        "has_optimizer",
        "save",
        "load",
        "set_version",
        "export_stats",
        "data_parallel_rank",
        "is_data_parallel_head",
        "broadcast_in_model_parallel_group",
        "lora_rank",
        "lora_serve",  # what a disk push sends with LoRA (weights/push.py)
        "hf_param_specs",
        "iter_hf_params",
    }
    assert not _members(TrainBackend) & _members(TrainEngine)


def test_capabilities_are_declared_not_probed() -> None:
    assert not attribute_probes(ALGORITHMS), "algorithms read declared engine members, never getattr/hasattr"
    flag = inspect.getattr_static(TrainEngine, "router_replay")
    assert isinstance(flag, property) and not flag.__isabstractmethod__  # a default (False), not a duty
