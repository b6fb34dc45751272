"""stats_tracker: local reductions with hand-computed values, and exact 2-rank gloo reductions."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from utils import free_port

from tandemrl.utils import stats_tracker
from tandemrl.utils.stats_tracker import ReduceType, StatsTracker


@pytest.fixture(autouse=True)
def _clean_trackers():
    stats_tracker.export_all()
    yield
    stats_tracker.export_all()


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _m(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.bool)


def test_default_avg_min_max_ignores_masked_values():
    t = StatsTracker()
    t.denominator(n_tok=_m(1, 0, 1, 1))
    t.stat(loss=_t(1.0, 100.0, -2.0, 4.0), denominator="n_tok")
    out = t.export()
    assert out == pytest.approx({"n_tok": 3.0, "loss/avg": 1.0, "loss/min": -2.0, "loss/max": 4.0})


@pytest.mark.parametrize(
    ("reduce_type", "expected"),
    [
        (ReduceType.AVG, {"x": 7.0 / 3.0}),
        (ReduceType.SUM, {"x": 7.0}),
        (ReduceType.MIN, {"x": 1.0}),
        (ReduceType.MAX, {"x": 4.0}),
        (ReduceType.SCALAR, {"x": 7.0 / 3.0, "x__count": 3.0}),
    ],
)
def test_each_reduce_type(reduce_type: ReduceType, expected: dict[str, float]):
    t = StatsTracker()
    t.denominator(valid=_m(1, 1, 0, 1))
    t.stat(x=_t(1.0, 2.0, -9.0, 4.0), denominator="valid", reduce_type=reduce_type)
    out = t.export()
    assert out.pop("valid") == 3.0
    assert out == pytest.approx(expected)


def test_two_micro_batches_average_over_all_elements():
    t = StatsTracker()
    t.denominator(n=_m(1, 1))
    t.stat(v=_t(1.0, 3.0), denominator="n")  # mean 2 over 2 elements
    t.denominator(n=_m(1, 0, 0))
    t.stat(v=_t(8.0, 0.0, 0.0), denominator="n")  # mean 8 over 1 element
    out = t.export()
    assert out["n"] == 3.0
    assert out["v/avg"] == pytest.approx(4.0)  # (1+3+8)/3, not (2+8)/2
    assert (out["v/min"], out["v/max"]) == (1.0, 8.0)


def test_2d_tensor_with_token_mask():
    t = StatsTracker()
    mask = torch.tensor([[True, True, False], [True, False, False]])
    t.denominator(n_valid_tokens=mask, n_seqs=torch.ones(2, dtype=torch.bool))
    t.stat(adv=torch.tensor([[1.0, 2.0, 50.0], [6.0, 50.0, 50.0]]), denominator="n_valid_tokens")
    t.stat(reward=_t(0.0, 1.0), denominator="n_seqs", reduce_type=ReduceType.AVG)
    out = t.export()
    assert out["n_valid_tokens"] == 3.0 and out["n_seqs"] == 2.0
    assert out["adv/avg"] == pytest.approx(3.0) and out["adv/max"] == 6.0
    assert out["reward"] == pytest.approx(0.5)


def test_scalars_mean_and_count():
    t = StatsTracker()
    t.scalar(lr=1.0, eps=0.2)
    t.scalar(lr=3.0)
    t.scalar(lr=torch.tensor(5.0))
    out = t.export()
    assert out == pytest.approx({"lr": 3.0, "lr__count": 3.0, "eps": 0.2, "eps__count": 1.0})


def test_nested_scopes_and_func_wrapper():
    t = StatsTracker()

    @t.scope_func_wrapper("fn")
    def inner() -> None:
        t.scalar(z=2.0)

    with t.scope("a"):
        with t.scope("b"):
            t.scalar(c=1.0)
            inner()
        t.denominator(d=_m(1, 1))
        t.stat(s=_t(1.0, 3.0), denominator="d", reduce_type=ReduceType.SUM)
    t.scalar(top=0.0)
    out = t.export()
    assert set(out) == {"a/b/c", "a/b/c__count", "a/b/fn/z", "a/b/fn/z__count", "a/d", "a/s", "top", "top__count"}
    assert out["a/s"] == 4.0


def test_denominator_is_resolved_in_current_scope():
    t = StatsTracker()
    t.denominator(n=_m(1))
    with t.scope("inner"), pytest.raises(KeyError, match="inner/n"):
        t.stat(x=_t(1.0), denominator="n")


def test_export_reset_and_key_filter():
    t = StatsTracker()
    with t.scope("actor"):
        t.scalar(loss=2.0)
    t.scalar(other=1.0)
    assert t.export(key="actor", reset=False) == {"actor/loss": 2.0, "actor/loss__count": 1.0}
    assert t.export(key="actor") == {"actor/loss": 2.0, "actor/loss__count": 1.0}
    assert t.export(key="actor") == {}
    assert t.export() == {"other": 1.0, "other__count": 1.0}
    assert t.export() == {}


def test_zero_denominator_omits_stat_but_reports_count():
    t = StatsTracker()
    t.denominator(empty=_m(0, 0))
    t.stat(x=_t(1.0, 2.0), denominator="empty")
    t.stat(y=_t(1.0, 2.0), denominator="empty", reduce_type=ReduceType.SUM)
    assert t.export() == {"empty": 0.0}


def test_bad_inputs_raise_clear_errors():
    t = StatsTracker()
    with pytest.raises(TypeError, match="'m'.*bool"):
        t.denominator(m=torch.ones(2))
    t.denominator(m=_m(1, 1))
    with pytest.raises(ValueError, match="'x' has shape"):
        t.stat(x=_t(1.0, 2.0, 3.0), denominator="m")
    with pytest.raises(KeyError, match="missing"):
        t.stat(x=_t(1.0, 2.0), denominator="missing")
    t.stat(x=_t(1.0, 2.0), denominator="m", reduce_type=ReduceType.SUM)
    with pytest.raises(ValueError, match="'x'"):
        t.stat(x=_t(1.0, 2.0), denominator="m", reduce_type=ReduceType.MAX)
    with pytest.raises(ValueError, match="'x'"):
        t.scalar(x=1.0)
    with pytest.raises(TypeError, match="'bad'"):
        t.scalar(bad="high")


def test_record_timing_key_and_value():
    """The recorded time covers the block (an interval measured inside it) and no more than an
    interval measured around it: an order of readings of the same clock, on any machine."""
    t = StatsTracker()
    outer_start = time.perf_counter()
    with t.record_timing("step"):
        inner_start = time.perf_counter()
        time.sleep(0.01)
        inner = time.perf_counter() - inner_start
    outer = time.perf_counter() - outer_start
    with t.scope("actor"), t.record_timing("update"):
        pass
    out = t.export()
    assert set(out) == {
        "timeperf/step",
        "timeperf/step__count",
        "timeperf/actor/update",
        "timeperf/actor/update__count",
    }
    assert inner <= out["timeperf/step"] <= outer


def test_module_api_named_trackers_and_export_all():
    stats_tracker.scalar(grad_norm=1.5)
    with stats_tracker.scope("s"):
        stats_tracker.denominator(n=_m(1, 0))
        stats_tracker.stat(v=_t(2.0, 9.0), denominator="n", reduce_type=ReduceType.MAX)
    stats_tracker.get("rollout").scalar(reward=0.5)
    stats_tracker.get("rollout").scalar(reward=1.0)
    assert stats_tracker.get("rollout") is stats_tracker.get("rollout")
    with stats_tracker.record_timing("gen"):
        pass
    out = stats_tracker.export_all()
    timing = out.pop("timeperf/gen")
    assert timing >= 0.0
    assert out == pytest.approx(
        {
            "grad_norm": 1.5,
            "grad_norm__count": 1.0,
            "s/n": 1.0,
            "s/v": 2.0,
            "rollout/reward": 0.75,
            "rollout/reward__count": 2.0,
            "timeperf/gen__count": 1.0,
        }
    )
    assert stats_tracker.export_all() == {}


def test_module_export_covers_default_tracker_only():
    stats_tracker.scalar(a=1.0)
    stats_tracker.get("rollout").scalar(r=2.0)
    assert stats_tracker.export() == {"a": 1.0, "a__count": 1.0}
    assert stats_tracker.get("rollout").export() == {"rollout/r": 2.0, "rollout/r__count": 1.0}


def test_thread_records_while_main_exports():
    tracker = stats_tracker.get("rollout-thread-test")
    n = 3000

    def produce() -> None:
        for _ in range(n):
            tracker.scalar(x=1.0)

    th = threading.Thread(target=produce)
    th.start()
    total = 0.0
    while th.is_alive():
        total += tracker.export().get("rollout-thread-test/x__count", 0.0)
    th.join()
    total += tracker.export().get("rollout-thread-test/x__count", 0.0)
    assert total == n


# ----------------------------------------------------------------- 2 ranks (gloo)
def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if rank == 0:
            values, mask = _t(1.0, 2.0, 100.0, 3.0), _m(1, 1, 0, 1)
            lrs = [1.0, 2.0]
        else:
            values, mask = _t(10.0, -50.0), _m(1, 0)
            lrs = [6.0]
        stats_tracker.denominator(n=mask, empty=torch.zeros_like(mask))
        stats_tracker.stat(loss=values, denominator="n")
        for name, rt in [("avg", ReduceType.AVG), ("sum", ReduceType.SUM), ("min", ReduceType.MIN)]:
            stats_tracker.stat(denominator="n", reduce_type=rt, **{f"loss_{name}": values})
        stats_tracker.stat(loss_max=values, denominator="n", reduce_type=ReduceType.MAX)
        stats_tracker.stat(loss_scalar=values, denominator="n", reduce_type=ReduceType.SCALAR)
        stats_tracker.stat(never=values, denominator="empty")
        for lr in lrs:
            stats_tracker.scalar(lr=lr)
        if rank == 1:  # keys and a tracker that only exist on one rank
            stats_tracker.scalar(only_r1=7.0)
            with stats_tracker.scope("r1"):
                stats_tracker.denominator(d=_m(1, 1))
                stats_tracker.stat(w=_t(3.0, 5.0), denominator="d", reduce_type=ReduceType.AVG)
        else:
            stats_tracker.get("rollout").scalar(reward=0.25)
        first = stats_tracker.export_all(reduce_group=dist.group.WORLD)
        # A second round where only rank 0 has anything to export must not hang either.
        if rank == 0:
            stats_tracker.scalar(late=4.0)
        second = stats_tracker.export_all(reduce_group=dist.group.WORLD)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"first": first, "second": second}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_rank_gloo_reduction_is_exact(tmp_path: Path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == r1  # every rank receives identical results
    # Selected elements over both ranks: rank0 {1, 2, 3}, rank1 {10} -> 16 / 4.
    expected = {
        "n": 4.0,
        "empty": 0.0,
        "loss/avg": 4.0,  # the average of per-rank averages would be 6
        "loss/min": 1.0,
        "loss/max": 10.0,
        "loss_avg": 4.0,
        "loss_sum": 16.0,
        "loss_min": 1.0,
        "loss_max": 10.0,
        "loss_scalar": 4.0,
        "loss_scalar__count": 4.0,
        "lr": 3.0,  # (1 + 2 + 6) / 3; the mean of per-rank means would be 3.75
        "lr__count": 3.0,
        "only_r1": 7.0,
        "only_r1__count": 1.0,
        "r1/d": 2.0,
        "r1/w": 4.0,
        "rollout/reward": 0.25,
        "rollout/reward__count": 1.0,
    }
    assert r0["first"] == pytest.approx(expected)
    assert r0["second"] == {"late": 4.0, "late__count": 1.0}
