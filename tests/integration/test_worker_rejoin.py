"""A worker found through the pools' records (``asyncrl worker --registry RUN_DIR``) follows a trainer restart: when
the pools it served go silent (a rank killed, the launcher restarting the gang on new endpoints) it waits for the
next incarnation's records and serves those pools; it never serves the silent ones again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.cluster.registry import pool_record, write_pool_record
from asyncrl.config import to_dict

pytestmark = pytest.mark.integration

PROMPTS = [{"text": f"prompt {i}"} for i in range(16)]


def _loader(incarnation: str) -> RolloutLoader:
    config = LoaderConfig(group_size=2, batch_size=2, capacity=4, max_staleness=None, wait_timeout_s=60,
                          transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=2),
                          worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=4)))
    return RolloutLoader(PROMPTS, config, incarnation=incarnation)


def _advertise(run_dir: Path, loader: RolloutLoader, incarnation: str) -> None:
    cfg = loader.config
    write_pool_record(run_dir, pool_record(rank=0, world_size=1, incarnation=incarnation, endpoint=loader.endpoint,
                                           transport=to_dict(cfg.transport), worker=to_dict(cfg.worker),
                                           weights={"type": "none", "address": None, "delta": False}))


def test_a_registry_worker_serves_the_next_incarnation_after_its_pools_go_silent(tmp_path: Path):
    run_dir = tmp_path / "run"
    first = _loader("first")
    _advertise(run_dir, first, "first")
    worker = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "worker", "--registry", str(run_dir), "--worker-id",
                               "w", "--registry-timeout-s", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        with first:
            next(iter(first))  # the worker serves the first incarnation
            first.receiver.close(shutdown_workers=False)  # killed, not shut down: the worker hears nothing more
        second = _loader("second")
        with second:
            _advertise(run_dir, second, "second")  # the restarted trainer's record replaces the dead one's
            groups = [g for batch in second for g in batch["group_ids"]]
            served = second.stats()["transport"]["workers"]
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert sorted(groups) == sorted(f"e0-p{i}" for i in range(len(PROMPTS)))
    assert list(served) == ["w"]
    assert "waiting up to 60 s (--registry-timeout-s) for the run's next trainer" in err, err[-2000:]
    assert worker.returncode == 0, err[-2000:]  # the second loader's SHUTDOWN ended it
