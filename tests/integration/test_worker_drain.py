"""A worker removed on purpose drains: SIGTERM makes ``asyncrl worker`` flush the groups it finished and say BYE, so
its pool re-issues its other leases at once (``worker_left``), not after ``peer_timeout_s`` (``workers_lost``), and
the epoch still ends with every group exactly once (what the Ray engine does to a worker it scales down)."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig

pytestmark = pytest.mark.integration


def _worker(endpoint: str, worker_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "worker", "--connect", endpoint, "--worker-id",
                             worker_id, "--set", "transport.heartbeat_s=0.2", "--set", "worker.slots=2",
                             "--set", "worker.engine.seconds_per_token=0.02"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigterm_drains_a_worker_without_waiting_for_its_timeout():
    config = LoaderConfig(group_size=2, batch_size=2, capacity=8, max_staleness=None, wait_timeout_s=60,
                          transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=30),  # a lost peer would stall
                          worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8)))
    prompts = [{"prompt_ids": [i + 1]} for i in range(24)]
    with RolloutLoader(prompts, config) as loader:
        leaving = _worker(loader.endpoint, "leaving")
        staying = None
        try:
            it = iter(loader)
            groups = list(next(it)["group_ids"])
            deadline = time.monotonic() + 20
            while not loader.stats()["transport"]["workers"].get("leaving", {}).get("groups", 0):  # it serves
                assert time.monotonic() < deadline, loader.stats()["transport"]["workers"]
                time.sleep(0.02)
            t0 = time.monotonic()
            leaving.send_signal(signal.SIGTERM)
            assert leaving.wait(20) == 0, leaving.stderr.read()[-2000:]
            staying = _worker(loader.endpoint, "staying")
            groups += [g for batch in it for g in batch["group_ids"]]
            elapsed = time.monotonic() - t0
            stats = loader.stats()["transport"]
        finally:
            for proc in (leaving, staying):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    counts = collections.Counter(groups)
    assert sorted(counts) == sorted(f"e0-p{i}" for i in range(24)) and max(counts.values()) == 1
    assert stats.get("worker_left", 0) >= 1 and stats.get("workers_lost", 0) == 0, stats
    assert elapsed < config.transport.peer_timeout_s  # its leases came back at once, not after the timeout
