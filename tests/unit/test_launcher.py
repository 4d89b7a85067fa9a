"""The local launcher's restart policy: unlimited or n restarts per slot, exponential backoff per slot that
resets after a worker stayed up, all counted; with real (tiny) processes and a fake clock, never wall time."""

from __future__ import annotations

import sys

import pytest

from asyncrl.config import LoaderConfig, TransportConfig, WorkerConfig
from datapipes.loader import _max_restarts
from workers.launcher import LocalWorkerLauncher


class CrashingLauncher(LocalWorkerLauncher):
    """Its 'workers' are interpreters that exit with 3 at once (a worker that crashes on start-up)."""

    def _argv(self, i: int) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.exit(3)"]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def launcher(**kw) -> tuple[CrashingLauncher, FakeClock]:
    clock = FakeClock()
    kw.setdefault("backoff_s", 1.0)
    kw.setdefault("backoff_max_s", 60.0)
    return CrashingLauncher(["tcp://127.0.0.1:1"], 1, WorkerConfig(), TransportConfig(), clock=clock, **kw), clock


def wait_dead(lau: LocalWorkerLauncher) -> None:
    """Waits (bounded) for every started process to exit, so the next poll sees it."""
    for p in lau.procs:
        if p is not None:
            p.wait(timeout=60)


def crash_loop(lau: CrashingLauncher, clock: FakeClock, deaths: int, ran_s: float = 0.5) -> None:
    """Lets the slot die ``deaths`` times; each worker 'runs' ``ran_s`` fake seconds, then the clock jumps to
    its scheduled restart."""
    for _ in range(deaths):
        wait_dead(lau)
        clock.now += ran_s
        assert lau.poll() == [(0, 3)]
        if not lau.pending_restarts:
            return
        clock.now += lau.restart_delays[0][-1] - 1e-6
        lau.poll()
        assert lau.procs[0] is None, "restarted before its backoff passed"
        clock.now += 1e-6
        lau.poll()
        assert lau.procs[0] is not None


def test_unlimited_restarts_go_past_three_with_growing_backoff():
    lau, clock = launcher(max_restarts=None, backoff_s=1.0, backoff_max_s=60.0)
    try:
        lau.start()
        crash_loop(lau, clock, deaths=8)
        assert lau.restarts == [8] and lau.deaths == [8]
        assert list(lau.restart_delays[0]) == [1, 2, 4, 8, 16, 32, 60, 60]  # doubling, capped
        assert lau.recoverable()
        stats = lau.stats()
        assert stats["restarts"] == [8] and stats["last_restart_delay_s"] == [60] and stats["max_restarts"] is None
    finally:
        lau.shutdown()


def test_backoff_resets_after_a_worker_stayed_up():
    lau, clock = launcher(max_restarts=None, backoff_s=1.0, backoff_max_s=10.0)
    try:
        lau.start()
        crash_loop(lau, clock, deaths=3)
        crash_loop(lau, clock, deaths=1, ran_s=10.0)  # up for backoff_max_s: not a crash loop
        crash_loop(lau, clock, deaths=1)
        assert list(lau.restart_delays[0]) == [1, 2, 4, 1, 2]
    finally:
        lau.shutdown()


def test_n_restarts_then_the_slot_stays_empty():
    lau, clock = launcher(max_restarts=2)
    try:
        lau.start()
        crash_loop(lau, clock, deaths=5)
        assert lau.restarts == [2] and lau.deaths == [3]
        assert lau.alive() == 0 and not lau.pending_restarts and not lau.recoverable()
    finally:
        lau.shutdown()


def test_no_restarts():
    lau, clock = launcher(max_restarts=0)
    try:
        lau.start()
        crash_loop(lau, clock, deaths=1)
        assert lau.restarts == [0] and not lau.recoverable()
    finally:
        lau.shutdown()


@pytest.mark.parametrize(("setting", "limit"), [(True, None), (False, 0), (0, 0), (1, 1), (7, 7)])
def test_restart_workers_setting_is_a_bool_or_a_count(setting, limit):
    assert _max_restarts(LoaderConfig(restart_workers=setting).restart_workers) == limit


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_restart_workers_rejects_other_values(bad):
    with pytest.raises(ValueError, match="restart_workers"):
        LoaderConfig(restart_workers=bad)
