"""A broadcast that fails mid-transfer never commits: the worker keeps generating with the version it
has and reports the failure to the trainer (heartbeat status in the loader's stats)."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.config import WeightSyncConfig
from asyncrl.weights import ZmqWeightBroadcaster
from tests.weights_utils import corrupt_next

pytestmark = pytest.mark.integration


def _status(loader: RolloutLoader, key: str, want, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = loader.stats()["transport"]["workers"]
        if workers and all(want(w.get(key)) for w in workers.values()):
            return workers
        time.sleep(0.1)
    pytest.fail(f"worker status {key} never satisfied: {loader.stats()['transport']['workers']}")


def test_corrupted_broadcast_is_not_committed_and_is_reported():
    weights = {name: torch.arange(1024, dtype=torch.float32) for name in "abcd"}  # 4 buckets of 4 KiB
    broadcaster = ZmqWeightBroadcaster(bucket_bytes=4096)
    broadcaster.publish(weights, 0)
    config = LoaderConfig(
        group_size=2,
        batch_size=2,
        capacity=4,
        max_staleness=None,
        num_workers=1,
        wait_timeout_s=60,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=10),
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8, seconds_per_token=0.002),
                            # leases at the failed version wait catch_up_s for it, then generate with version 0
                            weights=WeightSyncConfig(type="zmq", address=broadcaster.address, catch_up_s=1.0)),
    )
    try:
        with RolloutLoader([{"prompt_ids": [i + 1]} for i in range(400)], config) as loader:
            it = iter(loader)
            next(it)
            corrupt_next(broadcaster, 2)
            loader.set_policy_version(1)  # the trainer's version moves first: no worker is ever ahead of it
            broadcaster.publish({k: v + 1 for k, v in weights.items()}, 1)
            _status(loader, "weight_sync_failures", lambda n: (n or 0) >= 1)
            versions = [int(v) for _ in range(3) for v in next(it)["policy_versions"]]
            assert set(versions) == {0}, "a version whose transfer failed must never be stamped"
            assert broadcaster.committed() and set(broadcaster.committed().values()) == {0}

            loader.set_policy_version(2)
            broadcaster.publish({k: v + 2 for k, v in weights.items()}, 2)  # the next clean version goes through
            _status(loader, "policy_version", lambda v: v == 2)
            later = [int(v) for _ in range(4) for v in next(it)["policy_versions"]]
            assert later[-1] == 2
    finally:
        broadcaster.close()
