"""What a loop is told when its weight sync is wired wrong, with real worker processes and a real shm broadcaster:
a wait that times out says why no group came (workers stuck at the initial weights while the trainer moved on), and
a loader rebuilt on a live broadcaster carries on with the documented pattern, while the naive one is refused with
a message that names it."""

from __future__ import annotations

import pytest
import torch

from asyncrl import (FakeEngineConfig, LoaderConfig, PolicySync, RolloutLoader, TransportConfig, WeightSyncConfig,
                     WorkerConfig, setup_weight_broadcaster)

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt_ids": [1 + i, 2, 3]} for i in range(64)]


def _config(address: str, **overrides) -> LoaderConfig:
    return LoaderConfig(**{
        "group_size": 2, "batch_size": 2, "max_staleness": 1, "num_workers": 1, "poll_timeout_s": 0.2,
        "transport": TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        # the fake engine follows the broadcaster once it has weights, like a real one
        "worker": WorkerConfig(engine=FakeEngineConfig(max_new_tokens=4),
                               weights=WeightSyncConfig(type="shm", address=address, catch_up_s=0.2)),
        **overrides})


def test_a_timed_out_wait_says_the_groups_were_stale_and_why():
    weights = setup_weight_broadcaster("shm")
    model = torch.nn.Linear(2, 2)
    try:
        with RolloutLoader(PROMPTS, _config(weights.address, wait_timeout_s=120)) as loader:
            PolicySync(model, loader, weights)  # version 0 published: the workers start from it
            it = iter(loader)
            next(it)  # the worker is up (its start-up is not what this test waits for)
            loader.pool_node.wait_timeout_s = 4
            loader.set_policy_version(2)  # the trainer moves on, but nothing more is ever published
            with pytest.raises(TimeoutError) as info:
                next(it)
    finally:
        weights.close()
    message = str(info.value)
    assert "no rollout group for " in message and "LoaderConfig.wait_timeout_s" in message
    assert "were dropped as stale: workers at policy version 0, trainer at 2 (LoaderConfig.max_staleness=1)" in message
    assert "give them a weight channel" in message and "'stale_dropped': 0" not in message


def test_a_loader_rebuilt_on_a_live_broadcaster_carries_on_with_the_documented_pattern():
    weights = setup_weight_broadcaster("shm")
    model = torch.nn.Linear(2, 2)
    try:
        first = RolloutLoader(PROMPTS, _config(weights.address, wait_timeout_s=120))
        sync = PolicySync(model, first, weights)
        next(iter(first))
        sync.commit(accepted=True)  # version 1 published
        first.close()
        loader = RolloutLoader(PROMPTS, _config(weights.address, wait_timeout_s=120), incarnation=first.incarnation)
        with loader:
            with pytest.raises(ValueError, match=r"version=1 must be greater than the last published version 1: .*"
                                                 r"publish_initial=False"):
                PolicySync(model, loader, weights, version=sync.policy_version)  # the naive rebuild
            sync = PolicySync(model, loader, weights, version=sync.policy_version, publish_initial=False)
            it = iter(loader)
            assert next(it)["policy_versions"].eq(1).all()  # the workers hold the published weights, not stale
            sync.commit(accepted=True)
            assert sync.policy_version == 2 and next(it) is not None
    finally:
        weights.close()
