"""`import tandemrl` stays light: heavy backends load only when used."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("megatron", "deepspeed", "vllm", "ray", "sglang")


def test_import_leaves_heavy_backends_out() -> None:
    code = (
        "import sys, tandemrl, tandemrl.engines, tandemrl.configs, tandemrl.utils, tandemrl.data, tandemrl.models;"
        "import tandemrl.engines.fsdp, tandemrl.engines.registry, tandemrl.utils.stats_tracker, tandemrl.api.allocation;"
        "import tandemrl.algorithms.ppo, tandemrl.algorithms.sft, tandemrl.algorithms.reinforce;"
        # Launcher modules load their backends (ray...) only when they run.
        "import tandemrl.launchers.local, tandemrl.launchers.ray, tandemrl.launchers.slurm, tandemrl.launchers.serve;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_configs_and_launchers_import_without_torch() -> None:
    """A config tool or a launcher node reads configs without torch: with torch made unimportable,
    `tandemrl.configs` (every config class and the loader), the launchers and the allocation parser
    import, and an allocation naming every built-in backend parses."""
    code = (
        "import importlib.abc, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import tandemrl.configs, tandemrl.api.allocation\n"
        "import tandemrl.launchers.local, tandemrl.launchers.ray, tandemrl.launchers.slurm\n"
        "from tandemrl.configs import GRPOConfig, read_config\n"
        "from tandemrl.configs.backends import parse_allocation\n"
        "for a in ('vllm:d1+fsdp:d2', 'sglang:d1+deepspeed:d1', 'vllm:d1+megatron:(attn:d1|ffn:e1)'):\n"
        "    parse_allocation(a)\n"
        "    assert GRPOConfig(allocation_mode=a).allocation.train is not None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_no_launcher_module_imports_omegaconf() -> None:
    """The launchers read their config through the typed loader (``configs.loader``, ``configs.launcher``): no
    module under tandemrl/launchers/ imports omegaconf itself (the raw YAML reader it once had is gone)."""
    import ast
    from pathlib import Path

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        return names

    launchers = Path(__file__).resolve().parents[2] / "tandemrl" / "launchers"
    found = sorted(p.name for p in launchers.glob("*.py") if "omegaconf" in imported(p))
    assert found == [], found
    configs = Path(__file__).resolve().parents[2] / "tandemrl" / "configs" / "loader.py"
    assert "omegaconf" in imported(configs)  # the check sees imports where they are
