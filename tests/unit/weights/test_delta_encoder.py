"""The zmq broadcaster's delta encoder threads: a key queued once while pending, jobs run in the background,
a job that raises is reported and the thread goes on, close() drops what is queued."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.weights._delta_encoder import DeltaEncoder

WAIT_S = 10.0


class Owner:
    pass


OWNER = Owner()  # held: a garbage-collected owner stops the threads


def wait_for(cond) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_key_is_queued_once_while_pending_and_errors_do_not_stop_the_thread():
    errors, done, gate = [], [], threading.Event()
    enc = DeltaEncoder(OWNER, threads=1, on_error=errors.append)
    try:
        assert enc.submit("a", lambda: (gate.wait(WAIT_S), done.append("a")))
        assert not enc.submit("a", lambda: done.append("again")) and enc.pending("a")
        assert enc.submit("bad", lambda: 1 / 0)
        assert enc.submit("b", lambda: done.append("b"))
        gate.set()
        wait_for(lambda: done == ["a", "b"] and not enc.pending("b"))
        assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError) and enc.alive
        assert enc.submit("a", lambda: done.append("a2"))  # no longer pending: queued again
        wait_for(lambda: done[-1:] == ["a2"])
    finally:
        enc.close()
    assert not enc.alive


def test_a_garbage_collected_owner_stops_the_threads():
    owner = Owner()
    enc = DeltaEncoder(owner, threads=1, on_error=lambda e: None)
    del owner
    wait_for(lambda: not enc.alive)
    enc.close()


def test_jobs_run_in_parallel_across_threads_and_close_drops_the_queued():
    both, release, ran, running = threading.Barrier(2, timeout=WAIT_S), threading.Event(), [], []
    enc = DeltaEncoder(OWNER, threads=2, on_error=lambda e: None)
    for k in range(2):  # each waits for the other: both must run at once
        enc.submit(k, lambda k=k: (both.wait(), running.append(k), release.wait(WAIT_S), ran.append(k)))
    enc.submit("queued", lambda: ran.append("queued"))
    wait_for(lambda: len(running) == 2)
    threading.Timer(0.05, release.set).start()
    enc.close()  # waits for the running jobs; the queued one never runs
    assert sorted(map(str, ran)) == ["0", "1"]


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads=0"):
        DeltaEncoder(OWNER, threads=0, on_error=lambda e: None)
