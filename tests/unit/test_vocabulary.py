"""One word per concept (docs/architecture.md, "Vocabulary"): the retired names stay retired.

- Each retired class name, imported from its old module, fails with the one line that names the new
  name and where it lives (an ImportError, no alias), and the new name is importable there.
- A retired attribute (of a trainer, of the executor) fails the same way; ``ReinforceActor`` refuses the old argument order.
- An old config key, in YAML or on the command line, fails with the line naming the new key and the
  release that drops the notice.
- No retired name is written anywhere in the package, the docs, the examples, the benchmarks, the
  README or CONTRIBUTING, except the table of renamed names itself.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from utils import REPO_ROOT

from tandemrl.api.renamed import REMOVED_IN, RENAMED, RENAMED_IN, RENAMED_MODULES
from tandemrl.configs import GRPOConfig, PPOActorConfig
from tandemrl.configs.loader import ConfigError
from tandemrl.trainers.entry import load_config

# The names the vocabulary pass retired (issue 34), written out so an emptied table still fails here.
RETIRED = ("RemoteInfEngine", "InferenceEngineConfig", "GenerationEngine", "LMEngine")
SCANNED = ("tandemrl", "docs", "examples", "bench", "README.md", "CONTRIBUTING.md")
TABLE = REPO_ROOT / "tandemrl" / "api" / "renamed.py"


def test_every_retired_name_is_in_the_table() -> None:
    assert {old for names in RENAMED.values() for old in names} == set(RETIRED)


@pytest.mark.parametrize(
    ("module", "old", "line"),
    [
        (
            "tandemrl.inference.remote",
            "RemoteInfEngine",
            f"RemoteInfEngine was renamed to RemoteInferenceClient in tandemrl {RENAMED_IN} (tandemrl.inference.remote)",
        ),
        (
            "tandemrl.configs",
            "InferenceEngineConfig",
            f"InferenceEngineConfig was renamed to InferenceClientConfig in tandemrl {RENAMED_IN} (tandemrl.configs)",
        ),
        (
            "tandemrl.configs.rollout",
            "InferenceEngineConfig",
            "InferenceEngineConfig was renamed to InferenceClientConfig in tandemrl "
            f"{RENAMED_IN} (tandemrl.configs.rollout)",
        ),
        (
            "tandemrl.api",
            "GenerationEngine",
            f"GenerationEngine was renamed to GenerationClient in tandemrl {RENAMED_IN} (tandemrl.api)",
        ),
        (
            "tandemrl.api.workflow",
            "GenerationEngine",
            f"GenerationEngine was renamed to GenerationClient in tandemrl {RENAMED_IN} (tandemrl.api.workflow)",
        ),
        (
            "tandemrl.workflows",
            "GenerationEngine",
            f"GenerationEngine was renamed to GenerationClient in tandemrl {RENAMED_IN} (tandemrl.workflows)",
        ),
        (
            "tandemrl.algorithms.lm",
            "LMEngine",
            f"LMEngine was renamed to SFTActor in tandemrl {RENAMED_IN} (tandemrl.algorithms.sft)",
        ),
    ],
)
def test_an_old_name_fails_with_the_line_naming_the_new_one(module: str, old: str, line: str) -> None:
    with pytest.raises(ImportError) as info:
        exec(f"from {module} import {old}", {})
    assert str(info.value) == line
    new, where = RENAMED[module][old]
    assert new in line and getattr(importlib.import_module(where), new).__name__ == new


def test_other_missing_names_stay_ordinary_attribute_errors() -> None:
    remote = importlib.import_module("tandemrl.inference.remote")
    assert not hasattr(remote, "NoSuchThing")
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing'"):
        exec("from tandemrl.workflows import NoSuchThing", {})


@pytest.mark.parametrize(
    ("cls_path", "old", "new"),
    [
        ("tandemrl.trainers.rl_loop.RLTrainer", "actor", "actor_engine"),
        ("tandemrl.trainers.sft.SFTTrainer", "engine", "actor_engine"),
        ("tandemrl.trainers.sft.SFTTrainer", "sft", "actor"),
        ("tandemrl.rollout.executor.WorkflowExecutor", "inference_engine", "client"),
    ],
)
def test_an_old_attribute_fails_with_the_new_name(cls_path: str, old: str, new: str) -> None:
    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    instance = object.__new__(cls)  # the attribute is read before anything is built
    with pytest.raises(AttributeError) as info:
        getattr(instance, old)
    assert str(info.value) == f"{name}.{old} was renamed to {name}.{new} in tandemrl {RENAMED_IN} ({module})"


def test_reinforce_actor_refuses_the_old_argument_order() -> None:
    from tandemrl.algorithms.reinforce import ReinforceActor

    with pytest.raises(TypeError, match=r"ReinforceActor\(config, engine\): config must be a PPOActorConfig"):
        ReinforceActor(cast(Any, object()), PPOActorConfig())
    assert ReinforceActor(PPOActorConfig(), engine=cast(Any, None)).config == PPOActorConfig()


def _load_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, GRPOConfig)
    return str(info.value)


def test_an_old_config_key_names_the_new_one_and_the_release_that_drops_it(tmp_path: Path) -> None:
    notice = f"; this notice goes in tandemrl {REMOVED_IN}"
    cli = _load_error(["actor.path=/m"])
    assert cli.startswith(f"Config key 'actor.path' moved to 'actor.engine.path'{notice}") and "\n" not in cli
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"actor": {"group_size": 2, "path": "/m"}}))
    in_yaml = _load_error(["--config", str(path)])
    assert f"Config key 'actor.path' moved to 'actor.engine.path'{notice}" in in_yaml and str(path) in in_yaml


def retired_uses(root: Path = REPO_ROOT) -> list[str]:
    """``path:line: text`` of every retired name written in the scanned files (the table excepted)."""
    pattern = re.compile(r"\b(" + "|".join(RETIRED) + r")\b")
    hits: list[str] = []
    for top in SCANNED:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            if path == root / TABLE.relative_to(REPO_ROOT) or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_no_retired_name_is_written_anywhere() -> None:
    hits = retired_uses()
    assert not hits, "retired names (tandemrl/api/renamed.py has their new ones):\n" + "\n".join(hits)


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED_MODULES.items()))
def test_a_renamed_module_fails_with_the_line_naming_the_new_one(old: str, new: str) -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(old)
    assert str(info.value) == f"module {old} was renamed to {new} in tandemrl {RENAMED_IN}"
    assert importlib.import_module(new).__name__ == new
    where = [
        str(p.relative_to(REPO_ROOT)) for top in ("tandemrl", "docs", "tests") for p in (REPO_ROOT / top).rglob("*")
    ]
    assert f"{old.replace('.', '/')}.py" not in where


def test_no_renamed_module_is_named_anywhere_but_the_tables() -> None:
    pattern = re.compile("|".join(re.escape(old) + r"\b" for old in RENAMED_MODULES))
    hits = [
        f"{p.relative_to(REPO_ROOT)}:{n}"
        for top in ("tandemrl", "docs", "examples", "bench", "scripts", "tests")
        for p in (REPO_ROOT / top).rglob("*")
        if p.suffix in (".py", ".md", ".yaml", ".sh") and p.resolve() not in (TABLE.resolve(), Path(__file__).resolve())
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits and {h.split(":")[0] for h in hits} == {"docs/architecture.md"}, hits  # the rename notice's prose
