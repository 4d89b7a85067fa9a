"""The fleet's floor (``rollout.min_workers``), with real worker processes: a loader whose fleet falls below it pauses
(nothing is yielded, its wait timeout does not fire) and resumes when a worker joins, and the epoch is still trained
exactly once across the pause (the dead worker's leases re-issued, the groups that arrived meanwhile kept)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig

pytestmark = pytest.mark.integration

PROMPTS = [{"text": f"prompt {i}"} for i in range(48)]


def _worker(endpoint: str, worker_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "worker", "--connect", endpoint, "--worker-id",
                             worker_id, "--set", "transport.heartbeat_s=0.2", "--set", "transport.peer_timeout_s=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_below_min_workers_the_loader_pauses_without_timing_out_and_resumes_when_a_worker_joins():
    config = LoaderConfig(group_size=2, batch_size=2, capacity=4, max_staleness=None, min_workers=2, wait_timeout_s=2,
                          poll_timeout_s=0.2, transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=1.5),
                          worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=4, seconds_per_token=0.01)))
    procs: list[subprocess.Popen] = []
    trained: list[str] = []
    try:
        with RolloutLoader(PROMPTS, config) as loader:
            it = iter(loader)
            procs.append(_worker(loader.endpoint, "a"))
            got: list = []
            first = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
            first.start()  # one worker serves: below the floor from the start, nothing is yielded
            _wait(lambda: loader.stats()["pool"].get("groups_received", 0) >= 2, 30)  # it serves; the groups are kept
            time.sleep(2.25 * config.wait_timeout_s)  # well past the wait timeout: paused, not timed out
            assert not got and first.is_alive() and loader.stats()["fleet"]["paused"]
            procs.append(_worker(loader.endpoint, "b"))
            first.join(30)
            assert got, "the loader did not resume when the second worker joined"
            trained += got[0]["group_ids"]
            for _ in range(6):
                trained += next(it)["group_ids"]
            procs[0].send_signal(signal.SIGKILL)  # a worker dies holding leases: below the floor again
            procs[0].wait(10)
            _wait(lambda: loader.receiver.ready_workers() == 1, 30)
            got.clear()
            second = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
            second.start()
            time.sleep(2.25 * config.wait_timeout_s)
            fleet = loader.stats()["fleet"]
            assert not got and second.is_alive() and fleet["paused"] and fleet["pauses"] == 2, fleet
            procs.append(_worker(loader.endpoint, "c"))  # capacity returns
            second.join(30)
            assert got, "the loader did not resume when a replacement joined"
            trained += got[0]["group_ids"]
            trained += [g for batch in it for g in batch["group_ids"]]  # the rest of the epoch
            fleet = loader.stats()["fleet"]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(20)
    counts = collections.Counter(trained)
    assert sorted(counts) == sorted(f"e0-p{i}" for i in range(len(PROMPTS))) and set(counts.values()) == {1}
    assert fleet["pauses"] == 2 and not fleet["paused"] and fleet["paused_s"] >= 2 * 2.25 * config.wait_timeout_s, fleet
    assert fleet["ready_workers"] == 2 and fleet["min_workers"] == 2
