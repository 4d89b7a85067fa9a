"""Nobody in on the weight channel: a non-loopback bind needs CURVE, and only listed worker keys get weights."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import TransportConfig
from asyncrl.transport.zmq import generate_curve_keys
from asyncrl.weights import WeightSyncError, ZmqWeightBroadcaster, ZmqWeightReceiver

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

WAIT_S = 10.0


def test_non_loopback_bind_without_curve_is_refused():
    refused = r"refusing to bind the weight broadcaster to 'tcp://0.0.0.0:0' beyond loopback"
    with pytest.raises(ValueError, match=refused):
        ZmqWeightBroadcaster("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="allow-list of worker public keys"):
        public, secret = generate_curve_keys()
        keys = TransportConfig(curve_secret_key=secret, curve_public_key=public)
        ZmqWeightBroadcaster("tcp://0.0.0.0:0", security=keys)
    b = ZmqWeightBroadcaster("tcp://0.0.0.0:0", security=TransportConfig(allow_insecure_remote=True))  # said out loud
    b.close()


def test_only_listed_receiver_keys_get_weights():
    server_public, server_secret = generate_curve_keys()
    worker_public, worker_secret = generate_curve_keys()
    _, stranger_secret = generate_curve_keys()
    b = ZmqWeightBroadcaster("tcp://0.0.0.0:0", security=TransportConfig(
        curve_secret_key=server_secret, curve_public_key=server_public, curve_allowed_keys=[worker_public]))
    opened = [b]
    try:
        b.publish({"w": torch.arange(1000.0)}, 1)
        address = b.address.replace("0.0.0.0", "127.0.0.1")
        stranger = ZmqWeightReceiver(address, receiver_id="stranger", timeout_s=1.0, server_key=server_public,
                                     security=TransportConfig(curve_client_secret_key=stranger_secret))
        opened.append(stranger)
        with pytest.raises(WeightSyncError, match="allow-list"):
            stranger.start()
        assert stranger.stats()["versions_staged"] == 0 and stranger.stats().get("bytes_received", 0) == 0
        assert b.stats()["curve_keys_refused"] >= 1 and b.stats().get("bytes_served", 0) == 0
        plain = ZmqWeightReceiver(address, receiver_id="plain", timeout_s=1.0)  # no CURVE at all
        opened.append(plain)
        with pytest.raises(WeightSyncError):
            plain.start()
        worker = ZmqWeightReceiver(address, receiver_id="worker", server_key=server_public,
                                   security=TransportConfig(curve_client_secret_key=worker_secret))
        opened.append(worker)
        worker.start()
        update = worker.wait(1, WAIT_S)
        assert update is not None and torch.equal(update.tensors["w"], torch.arange(1000.0))
        assert b.stats()["curve_keys_admitted"] >= 1 and set(b.stats()["receivers"]) == {"worker"}
    finally:
        for obj in reversed(opened):
            obj.close()
