"""Process-group teardown (``tandemrl.engines.teardown``) on 2 real gloo ranks, and its helpers."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch.distributed as dist
from utils import run_torchrun

from tandemrl.engines.teardown import drop_module_groups, gloo_worker_threads

WORKER = Path(__file__).resolve().parents[1] / "workers" / "teardown_drain.py"


def test_teardown_waits_for_a_collective_nobody_waited_on(tmp_path: Path) -> None:
    """Rank 1 tears down right after an unwaited all-reduce that rank 0 joins only afterwards, and
    keeps a reference to the group: when its teardown returns the collective must be complete."""
    out = tmp_path / "seen"
    run_torchrun(WORKER, 2, [tmp_path / "marker", out], env={"TANDEMRL_DIST_TIMEOUT": "60"}, timeout=240)
    assert json.loads(Path(f"{out}.1").read_text()) == {"completed": True}
    assert json.loads(Path(f"{out}.0").read_text()) == {"sum": 3.0}


def test_drop_module_groups_forgets_groups_in_globals_and_dicts() -> None:
    class FakeGroup(dist.ProcessGroup):  # a real ProcessGroup subclass; no backend is started
        pass

    group = FakeGroup(0, 1)
    mod = types.ModuleType("holder")
    mod.world, mod.by_name, mod.other = group, {"dp": group}, {"x": 1}
    drop_module_groups(mod)
    assert mod.world is None and mod.by_name == {} and mod.other == {"x": 1}


def test_gloo_worker_threads_counts_only_gloo_workers() -> None:
    assert gloo_worker_threads() == 0  # this pytest process runs no gloo group
