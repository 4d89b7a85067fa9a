"""Weights of a resumed trainer replace a dead incarnation's, whatever their version (zmq and shm).

A trainer that crashed at version 6 and resumed from its checkpoint of version 3 publishes version 3 again,
as a new incarnation. Before incarnations a receiver ignored it (3 is not newer than its committed 6) and
its worker kept generating with the dead run's weights.
"""

from __future__ import annotations

import shutil
import socket

import pytest
import torch

from asyncrl.weights import WeightUpdate, setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights._staging import StagingArea

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

WAIT_S = 10.0


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), float(version)), "b": torch.arange(3) + version}


def test_staging_area_orders_versions_within_an_incarnation_only():
    area = StagingArea("r")
    assert area.is_newer(0, "a")
    area.stage(WeightUpdate(version=6, mode="full", tensors={}, incarnation="a"))
    area.commit(6)
    assert not area.is_newer(6, "a") and not area.is_newer(3, "a") and area.is_newer(7, "a")
    assert area.is_newer(3, "b"), "a new incarnation's weights win whatever their version"
    area.stage(WeightUpdate(version=3, mode="full", tensors={}, incarnation="b"))
    assert area.poll().incarnation == "b"
    assert area.wait(3, 0.0, incarnation="a") is None, "waiting for another incarnation's weights"
    assert area.wait(3, 0.0, incarnation="b").version == 3
    area.commit(3)
    assert area.stats()["committed_version"] == 3 and area.stats()["committed_incarnation"] == "b"
    with pytest.raises(ValueError, match="not newer"):
        area.commit(3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_receiver_takes_a_resumed_incarnations_lower_version(backend, tmp_path):
    kw = {"bind": f"tcp://127.0.0.1:{free_port()}"} if backend == "zmq" else {"directory": tmp_path / "w"}
    dead = setup_weight_broadcaster(backend, **kw)
    receiver = setup_weight_receiver(backend, dead.address, receiver_id="r0")
    receiver.start()
    live = None
    try:
        for v in range(7):
            dead.publish(weights(v), v, incarnation="dead")
        update = receiver.wait(6, WAIT_S)
        assert update is not None and update.version == 6 and update.incarnation == "dead"
        receiver.commit(6)
        dead.close()  # the trainer crashes; its resume publishes the checkpoint's version 3 at the same address
        if backend == "shm":
            shutil.rmtree(tmp_path / "w")
        live = setup_weight_broadcaster(backend, **kw)
        live.publish(weights(3), 3, incarnation="live")
        update = receiver.wait(3, WAIT_S, incarnation="live")
        assert update is not None, f"the receiver ignored the resumed trainer's version 3: {receiver.stats()}"
        assert update.version == 3 and torch.equal(update.tensors["w"], weights(3)["w"])
        receiver.commit(3)
        live.publish(weights(4), 4, incarnation="live")
        update = receiver.wait(4, WAIT_S, incarnation="live")
        assert update is not None and torch.equal(update.tensors["b"], weights(4)["b"])
    finally:
        receiver.close()
        for b in (dead, live):
            if b is not None:
                b.close()


def test_weights_published_without_an_incarnation_satisfy_any_wait():
    """A publisher that does not stamp incarnations (older code, benchmarks) must not make every catch-up wait
    time out (seen: 10 s per batch and stale drops at max_staleness=0 in the freshness benchmark)."""
    area = StagingArea("r")
    area.stage(WeightUpdate(version=2, mode="full", tensors={}))
    assert area.wait(2, 0.0, incarnation="live").version == 2
