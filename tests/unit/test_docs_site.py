"""The docs site (mkdocs.yml, docs/, the API reference from docstrings) builds strictly, and documents
the public classes.

The build is the one `bash scripts/docs.sh` runs: `mkdocs build --strict`, with every link check of
mkdocs.yml's `validation` at warning level, so a broken link, a missing anchor, a page left out of the
nav or an API reference (`::: path`) that names no object fails it. A copy of the docs with one broken
link and one with one dangling reference show that the build does fail on them.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from utils import REPO_ROOT

# The public classes a newcomer reaches first: each needs its own docstring and a place in the
# API pages (docs/api/*.md). A class added to the public surface is added here.
PUBLIC_CLASSES = (
    "tandemrl.api.engine.TrainEngine",
    "tandemrl.engines.base.BaseTrainEngine",
    "tandemrl.engines.fsdp.FSDPEngine",
    "tandemrl.engines.deepspeed.DeepSpeedEngine",
    "tandemrl.engines.megatron.engine.MegatronEngine",
    "tandemrl.algorithms.ppo.PPOActor",
    "tandemrl.algorithms.ppo.PPOCritic",
    "tandemrl.algorithms.reinforce.ReinforceActor",
    "tandemrl.algorithms.distill.DistillActor",
    "tandemrl.algorithms.sft.SFTActor",
    "tandemrl.rollout.controller.RolloutController",
    "tandemrl.rollout.controller.InferenceClient",
    "tandemrl.rollout.executor.WorkflowExecutor",
    "tandemrl.trainers.rl_loop.RLTrainer",
    "tandemrl.trainers.sft.SFTTrainer",
    "tandemrl.trainers.base.TrainerBase",
    "tandemrl.api.workflow.RolloutWorkflow",
    "tandemrl.api.workflow.GenerationClient",
    "tandemrl.workflows.rlvr.RLVRWorkflow",
    "tandemrl.workflows.multi_turn.MultiTurnWorkflow",
    "tandemrl.workflows.remax.ReMaxRLVRWorkflow",
    "tandemrl.workflows.agent.AgentWorkflow",
    "tandemrl.workflows.distill.TeacherScoredWorkflow",
    "tandemrl.inference.remote.RemoteInferenceClient",
    "tandemrl.inference.weight_calls.WeightCalls",
    "tandemrl.api.backend.InferenceBackend",
)

SITE_SOURCES = ("mkdocs.yml", "docs", "CONTRIBUTING.md", "scripts/mkdocs_hooks.py")


def build(project: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the project at `project` into `site_dir` (what scripts/docs.sh runs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    return subprocess.run(
        cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )


def copy_project(dest: Path) -> Path:
    """The site's sources copied to `dest`, with the package linked beside them (mkdocstrings reads it)."""
    for name in SITE_SOURCES:
        src = REPO_ROOT / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest / name)
        else:
            shutil.copy2(src, dest / name)
    (dest / "tandemrl").symlink_to(REPO_ROOT / "tandemrl")
    return dest


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    proc = build(REPO_ROOT, site_dir)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return site_dir


def test_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in sorted((REPO_ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(REPO_ROOT / "docs").with_suffix("")
        out = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert out.is_file(), f"docs/{page.relative_to(REPO_ROOT / 'docs')} was not built"
    assert (site / "contributing" / "index.html").is_file(), "CONTRIBUTING.md is not in the site"


def test_config_page_lists_every_field_with_its_help(site: Path) -> None:
    import dataclasses

    from tandemrl.configs import GRPOConfig, PPOActorConfig

    html = (site / "api" / "configs" / "index.html").read_text(encoding="utf-8")
    for cls in (GRPOConfig, PPOActorConfig):
        assert f'id="{cls.__name__.lower()}"' in html, f"{cls.__name__} has no section in api/configs"
        for f in dataclasses.fields(cls):
            assert f"<code>{f.name}</code>" in html, f"{cls.__name__}.{f.name} is not in api/configs"
    eps = PPOActorConfig.__dataclass_fields__["eps_clip"].metadata["help"].split()[0]
    assert eps in html


@pytest.mark.parametrize("path", PUBLIC_CLASSES)
def test_public_class_is_documented(site: Path, path: str) -> None:
    module_name, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    assert (cls.__dict__.get("__doc__") or "").strip(), f"{path} has no docstring of its own"
    pages = "".join(p.read_text(encoding="utf-8") for p in (site / "api").rglob("index.html"))
    assert f'id="{path}"' in pages, f"{path} is not in the API reference (add `::: {path}` to docs/api/)"


@pytest.mark.parametrize(
    "page, text, expected",
    [
        ("index.md", "\nSee [the missing page](no_such_page.md).\n", "no_such_page.md"),
        ("api/rollout.md", "\n::: tandemrl.rollout.controller.NoSuchClass\n", "NoSuchClass"),
    ],
    ids=["broken-link", "dangling-api-reference"],
)
def test_strict_build_fails_on(tmp_path: Path, page: str, text: str, expected: str) -> None:
    project = copy_project(tmp_path / "project")
    with open(project / "docs" / page, "a", encoding="utf-8") as f:
        f.write(text)
    proc = build(project, tmp_path / "site")
    assert proc.returncode != 0, "the strict build passed with a broken docs page"
    assert expected in proc.stdout + proc.stderr
