"""PolicySync (asyncrl.train.policy_sync): the pool's version moves before every publish, a rejected step publishes
nothing but still commits, and the published weights carry the loader's incarnation (a real shm round trip)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.train.policy_sync import PolicySync
from asyncrl.weights import setup_weight_broadcaster, setup_weight_receiver


class FakeLoader:
    """The two members PolicySync uses, recording calls in a shared log."""

    incarnation = "inc-test"

    def __init__(self, log: list):
        self.log, self.version = log, None

    def set_policy_version(self, version: int) -> None:
        if self.version is not None and version < self.version:
            raise ValueError(f"{version=} < {self.version}")
        self.version = version
        self.log.append(("pool", version))


class FakeBroadcaster:
    def __init__(self, log: list):
        self.log = log

    def publish(self, tensors, version, *, mode, lora_config, incarnation):
        self.log.append(("publish", version, incarnation, sorted(tensors.keys())))
        return {"bytes": 0}


def test_the_pool_moves_before_every_publish_and_rejections_only_commit():
    log: list = []
    model = torch.nn.Linear(2, 2)
    sync = PolicySync(model, FakeLoader(log), FakeBroadcaster(log), version=3)
    assert log == [("pool", 3), ("publish", 3, "inc-test", ["bias", "weight"])]
    log.clear()
    first = sync.commit(accepted=True)
    rejected = sync.commit(accepted=False)
    second = sync.commit(accepted=True)
    assert [e[:2] for e in log] == [("pool", 4), ("publish", 4), ("pool", 4), ("pool", 5), ("publish", 5)]
    assert (first.policy_version, first.published, first.weight_bytes) == (4, True, 2 * 2 * 4 + 2 * 4)
    assert (rejected.policy_version, rejected.published, rejected.weight_bytes) == (4, False, 0)
    assert second.policy_version == sync.policy_version == 5


def test_ranks_without_a_broadcaster_still_move_their_pool():
    log: list = []
    sync = PolicySync(torch.nn.Linear(2, 2), FakeLoader(log), None)
    sync.commit(accepted=True)
    assert log == [("pool", 0), ("pool", 1)]


def test_a_negative_version_is_refused():
    with pytest.raises(ValueError, match="version=-1"):
        PolicySync(torch.nn.Linear(2, 2), FakeLoader([]), None, version=-1)


def test_workers_receive_the_committed_weights_with_the_incarnation(tmp_path):
    model = torch.nn.Linear(3, 2)
    broadcaster = setup_weight_broadcaster("shm", directory=tmp_path / "w")
    receiver = setup_weight_receiver("shm", broadcaster.address, receiver_id="r0")
    receiver.start()
    try:
        sync = PolicySync(model, FakeLoader([]), broadcaster)
        with torch.no_grad():
            model.weight.add_(1.0)
        sync.commit(accepted=True)
        update = receiver.wait(1, timeout=10)
        assert update is not None and update.version == 1 and update.incarnation == "inc-test"
        assert torch.equal(update.tensors["weight"], model.weight.detach())
    finally:
        receiver.close()
        broadcaster.close()
