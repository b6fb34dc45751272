"""StalenessManager: the capacity formula and thread-safe bookkeeping."""

from __future__ import annotations

import threading

import pytest

from tandemrl.rollout.staleness import StalenessManager


def _state(mgr: StalenessManager, accepted: int, rejected: int, running: int) -> None:
    for _ in range(accepted + rejected + running):
        mgr.on_submit()
    for _ in range(accepted):
        mgr.on_accept()
    for _ in range(rejected):
        mgr.on_reject()


# (max_concurrent, B, k, version, accepted, rejected, running) -> expected capacity
CASES = [
    ((8, 4, 0, 0, 0, 0, 0), 4),  # synchronous: one batch at a time
    ((8, 4, 0, 0, 0, 0, 4), 0),  # that batch is running
    ((8, 4, 0, 0, 4, 0, 0), 0),  # done but version not bumped yet
    ((8, 4, 0, 1, 4, 0, 0), 4),  # trainer moved on
    ((8, 4, 1, 0, 0, 0, 0), 8),  # one version ahead: two batches
    ((8, 4, 1, 1, 4, 0, 4), 4),  # min(8-4, 12-8)
    ((2, 4, 2, 0, 0, 0, 0), 2),  # concurrency bound wins
    ((8, 4, 0, 0, 0, 3, 1), 3),  # rejected rollouts give their slot back
    ((8, 4, 0, 2, 12, 5, 0), 0),  # already ahead of the trainer
    ((8, 4, 0, 1, 8, 0, 1), -1),  # over budget: negative, nothing may start
    ((16, 2, 3, 10, 25, 7, 2), 1),  # min(14, 28-27)
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_capacity_formula(args: tuple[int, ...], expected: int) -> None:
    max_conc, bsz, k, version, accepted, rejected, running = args
    mgr = StalenessManager(max_conc, bsz, k)
    _state(mgr, accepted, rejected, running)
    formula = min(max_conc - running, (k + version + 1) * bsz - (accepted + running))
    assert formula == expected  # the table itself follows the documented formula
    assert mgr.get_capacity(version) == expected
    s = mgr.get_stats()
    assert (s.submitted, s.accepted, s.rejected, s.running) == (
        accepted + rejected + running,
        accepted,
        rejected,
        running,
    )


def test_capacity_grows_with_version_only_through_staleness() -> None:
    mgr = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=3, max_head_offpolicyness=1)
    caps = [mgr.get_capacity(v) for v in range(4)]
    assert caps == [6, 9, 12, 15]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (
            {"max_concurrent_rollouts": 0, "consumer_batch_size": 1, "max_head_offpolicyness": 0},
            "max_concurrent_rollouts",
        ),
        ({"max_concurrent_rollouts": 1, "consumer_batch_size": 0, "max_head_offpolicyness": 0}, "consumer_batch_size"),
        (
            {"max_concurrent_rollouts": 1, "consumer_batch_size": 1, "max_head_offpolicyness": -1},
            "max_head_offpolicyness",
        ),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StalenessManager(**kwargs)


def test_finish_without_running_is_an_error() -> None:
    mgr = StalenessManager(1, 1, 0)
    with pytest.raises(RuntimeError, match="none was running"):
        mgr.on_accept()


def test_concurrent_bookkeeping_is_consistent() -> None:
    mgr = StalenessManager(10**9, 1, 0)
    n_threads, per_thread = 8, 2000

    def work(i: int) -> None:
        for j in range(per_thread):
            mgr.on_submit()
            mgr.get_capacity(j)
            mgr.on_finish(accepted=(i + j) % 3 != 0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = mgr.get_stats()
    total = n_threads * per_thread
    expected_rejected = sum(1 for i in range(n_threads) for j in range(per_thread) if (i + j) % 3 == 0)
    assert s.submitted == total and s.running == 0
    assert s.rejected == expected_rejected and s.accepted == total - expected_rejected
