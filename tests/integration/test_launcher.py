"""The local launcher's restart policy: unlimited or n restarts per slot, exponential backoff per slot that
resets after a worker stayed up, all counted; with real (tiny) processes and a fake clock, never wall time."""

from __future__ import annotations

import sys

import pytest

from asyncrl.config import LoaderConfig, TransportConfig, WorkerConfig
from datapipes.loader import _max_restarts
from workers.launcher import LocalWorkerLauncher

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


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


# -- a worker that cannot start ----------------------------------------------------------------------------------------

FAILING = ("import os, sys; sys.stderr.write('Traceback (most recent call last):\\n  File \"w.py\", line 1\\n'); "
           "sys.stderr.write(f'OSError: no model at /m (pid {os.getpid()})\\n'); sys.exit(3)")
"""A 'worker' that dies at start-up with the same error each time (its pid, in the message, differs)."""
WANDERING = ("import random, string, sys; "
             "sys.stderr.write('RuntimeError: ' + ''.join(random.choices(string.ascii_letters, k=12)) + '\\n'); "
             "sys.exit(3)")
"""A 'worker' that dies at start-up with a different error each time (a transient fault, not a broken set-up)."""


class FailingLauncher(CrashingLauncher):
    script = FAILING

    def _argv(self, i: int) -> list[str]:
        return [sys.executable, "-c", self.script]


def failing(script: str = FAILING, **kw) -> tuple[FailingLauncher, FakeClock]:
    clock = FakeClock()
    lau = FailingLauncher(["tcp://127.0.0.1:1"], 1, WorkerConfig(), TransportConfig(), clock=clock, backoff_s=1.0,
                          backoff_max_s=60.0, **kw)
    lau.script = script
    return lau, clock


def test_a_worker_that_dies_before_its_first_group_with_the_same_error_is_given_up(capfd):
    lau, clock = failing(max_restarts=None, max_failed_starts=3)
    try:
        lau.start()
        assert lau.start_error() is None
        crash_loop(lau, clock, deaths=3)
        assert lau.deaths == [3] and lau.restarts == [2] and lau.failed_starts == [3]
        assert not lau.pending_restarts and not lau.recoverable()  # not restarted forever ("restart 3 of unlimited")
        error = lau.start_error()
        assert error is not None and error.worker_id == "w-0" and error.deaths == 3 and error.returncode == 3
        assert "rollout worker w-0 cannot start: it died 3 times in a row before its first group, each time with: " \
               "OSError: no model at /m (pid" in str(error)
        assert "Traceback (most recent call last)" in error.stderr  # its last stderr lines, whole
        assert lau.stats()["failed_starts"] == [3]
        assert capfd.readouterr().err.count("OSError: no model at /m") == 3  # still shown, as when it inherited fd 2
    finally:
        lau.shutdown()


def test_different_errors_each_time_keep_today_s_restart_policy():
    lau, clock = failing(WANDERING, max_restarts=None, max_failed_starts=2)
    try:
        lau.start()
        crash_loop(lau, clock, deaths=5)
        assert lau.restarts == [5] and lau.failed_starts == [1] and lau.start_error() is None and lau.recoverable()
    finally:
        lau.shutdown()


def test_a_worker_that_served_keeps_today_s_restart_policy():
    lau, clock = failing(max_restarts=None, max_failed_starts=2)
    try:
        lau.start()
        for _ in range(5):  # each process delivers a group (the loader says so), then dies the same way
            lau.served([lau.procs[0].pid])
            crash_loop(lau, clock, deaths=1)
        assert lau.restarts == [5] and lau.failed_starts == [0] and lau.start_error() is None and lau.recoverable()
        crash_loop(lau, clock, deaths=2)  # from now on it never serves: given up after two identical deaths
        assert lau.start_error() is not None and not lau.recoverable()
    finally:
        lau.shutdown()


def test_signature_blanks_what_differs_between_attempts():
    from workers._stderr import signature

    a = signature("Traceback ...\nOSError: port 40123 in use by pid 77 at 0x7f00ab\n", 1)
    assert a == signature("OSError: port 40999 in use by pid 12 at 0x7f11cd", 1) == "OSError: port # in use by pid # at #"
    assert signature("", -9) == "exit status -9"
