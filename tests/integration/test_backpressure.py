"""Backpressure: with the consumer stalled, workers stop after their credits; memory stays bounded."""

from __future__ import annotations

import time

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig

pytestmark = pytest.mark.integration

CAPACITY = 8
GROUP_SIZE = 2
MAX_NEW_TOKENS = 64


def test_stalled_trainer_stops_generation_and_bounds_memory():
    config = LoaderConfig(
        group_size=GROUP_SIZE,
        batch_size=2,
        capacity=CAPACITY,
        num_workers=2,
        max_staleness=None,
        wait_timeout_s=60,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        worker=WorkerConfig(slots=4, max_batch=2,
                            engine=FakeEngineConfig(min_new_tokens=MAX_NEW_TOKENS, max_new_tokens=MAX_NEW_TOKENS)),
    )
    prompts = [{"prompt_ids": list(range(1, 17))} for _ in range(400)]
    with RolloutLoader(prompts, config) as loader:
        it = iter(loader)
        next(it)  # workers are up and generating
        time.sleep(2.0)  # the trainer stalls
        s1 = loader.stats()
        time.sleep(2.0)
        s2 = loader.stats()

        consumed = s2["consumed"] + s2["delivered"]  # the batch taken is delivered, its update not committed
        # nothing more was generated while stalled: every credit is used up
        assert s2["pool"]["groups_received"] == s1["pool"]["groups_received"]
        assert s2["transport"]["leases_granted"] == s1["transport"]["leases_granted"]
        # leased + buffered never exceeded the capacity; received <= consumed + capacity
        assert s2["peak"]["groups_in_flight"] <= CAPACITY
        assert s2["pool"]["groups_received"] <= consumed + CAPACITY
        assert s2["groups_in_flight"] == CAPACITY
        # memory: buffered bytes bounded by capacity x the largest group
        group_bytes = GROUP_SIZE * (16 * 4 + MAX_NEW_TOKENS * 4 + MAX_NEW_TOKENS * 4)
        assert s2["peak"]["buffered_bytes"] <= CAPACITY * group_bytes

        # the trainer resumes: generation resumes, and the whole epoch arrives
        rest = [g for batch in it for g in batch["group_ids"]]
        assert len(rest) + 2 == len(prompts)
