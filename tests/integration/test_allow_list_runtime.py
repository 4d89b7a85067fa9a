"""The pool's CURVE allow-list changed while it runs: authorize on join, revoke on death or removal.

A revoked key is refused from then on: the connected worker is dropped at once (its leases re-issued), each further
message on its connection is refused and counted, and a new handshake with that key fails at ZAP. The watched
allow-list file (``transport.curve_allowed_keys_file``, rewritten whole by ``asyncrl.cluster.registry``) does the
same from another process.
"""

from __future__ import annotations

import os
import time

import pytest
import zmq

from asyncrl.cluster.registry import write_allow_list
from asyncrl.codec import decode, encode
from asyncrl.config import TransportConfig
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.transport import protocol as P
from asyncrl.transport.zmq import ZmqRolloutReceiver, generate_curve_keys

pytestmark = pytest.mark.integration


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _Peer:
    """A raw CURVE DEALER speaking the worker protocol (what a revoked worker would keep sending)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, server_key: str, name: str):
        self.public, secret = generate_curve_keys()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_serverkey, self.sock.curve_publickey = server_key.encode(), self.public.encode()
        self.sock.curve_secretkey = secret.encode()
        self.secret, self.endpoint, self.name, self.server_key = secret, endpoint, name, server_key

    def connect(self) -> None:
        self.sock.connect(self.endpoint)

    def hello(self) -> None:
        self.sock.send_multipart(encode(P.HELLO, {"worker_id": self.name, "slots": 2, "pid": os.getpid(),
                                                  "host": "test", "protocol": P.PROTOCOL_VERSION}))

    def recv_kinds(self, timeout_s: float = 2.0) -> list[str]:
        kinds, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                kinds.append(decode(self.sock.recv_multipart())[0])
            elif kinds:
                break
        return kinds

    def reconnect_as_same_key(self, ctx: zmq.Context) -> None:
        self.sock.close(linger=0)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_serverkey = self.server_key.encode()
        self.sock.curve_publickey, self.sock.curve_secretkey = self.public.encode(), self.secret.encode()
        self.connect()


@pytest.fixture
def pool_keys():
    return generate_curve_keys()


def _receiver(tmp_path, public, secret, keys_file=None, keys=()):
    config = TransportConfig(heartbeat_s=0.2, peer_timeout_s=5, curve_public_key=public, curve_secret_key=secret,
                             curve_allowed_keys=list(keys), curve_allowed_keys_file=keys_file)
    pool = RolloutPool(PromptLedger(64, lease_timeout_s=60), group_size=2, capacity=8)
    receiver = ZmqRolloutReceiver(config, pool, lambda i: {"prompt_ids": [i + 1]})
    return receiver, receiver.start()


def test_authorize_then_revoke_in_process(tmp_path, pool_keys):
    public, secret = pool_keys
    ctx = zmq.Context()
    (tmp_path / "empty").write_text("")
    receiver, endpoint = _receiver(tmp_path, public, secret, keys_file=str(tmp_path / "empty"))  # nobody yet
    a = _Peer(ctx, endpoint, public, "a")
    try:
        a.connect()
        a.hello()
        assert P.WELCOME not in a.recv_kinds(1.0)  # not on the list: the handshake never completes
        assert _wait(lambda: receiver.stats().get("curve_keys_refused", 0) >= 1)

        receiver.authorize(a.public)  # authorize on join: its next connection is admitted (libzmq does not retry a
        a.reconnect_as_same_key(ctx)  # handshake refused by ZAP: a launcher authorizes before the worker starts)
        a.hello()
        assert _wait(lambda: "a" in receiver.stats()["workers"], 15), receiver.stats()

        receiver.revoke(a.public)  # revoke on death/removal: dropped at once, its leases back in the ledger
        assert _wait(lambda: receiver.stats().get("workers_revoked", 0) == 1)
        assert "a" not in receiver.stats()["workers"]
        for _ in range(3):  # whatever it still sends on the live connection is refused and counted
            a.sock.send_multipart(encode(P.HEARTBEAT, {}))
        a.hello()
        assert _wait(lambda: receiver.stats().get("curve_key_revoked_messages", 0) >= 4), receiver.stats()
        assert "a" not in receiver.stats()["workers"]
        refused = receiver.stats().get("curve_keys_refused", 0)
        a.reconnect_as_same_key(ctx)  # a new connection with the revoked key fails at ZAP
        a.hello()
        assert _wait(lambda: receiver.stats().get("curve_keys_refused", 0) > refused)
        assert "a" not in receiver.stats()["workers"]
    finally:
        a.sock.close(linger=0)
        receiver.close()
        ctx.term()


def test_watched_file_authorizes_and_revokes(tmp_path, pool_keys):
    public, secret = pool_keys
    ctx = zmq.Context()
    keys_file = tmp_path / "allowed"
    write_allow_list(keys_file, [])
    receiver, endpoint = _receiver(tmp_path, public, secret, keys_file=str(keys_file))
    a, b = _Peer(ctx, endpoint, public, "a"), _Peer(ctx, endpoint, public, "b")
    try:
        write_allow_list(keys_file, [a.public, b.public])  # both authorized before they start: no refusal
        for peer in (a, b):
            peer.connect()
            peer.hello()
        assert _wait(lambda: set(receiver.stats()["workers"]) == {"a", "b"}), receiver.stats()
        assert receiver.stats().get("curve_keys_refused", 0) == 0
        write_allow_list(keys_file, [b.public])  # a left the list (its worker died): refused from then on
        assert _wait(lambda: receiver.stats().get("workers_revoked", 0) == 1), receiver.stats()
        assert set(receiver.stats()["workers"]) == {"b"}
        a.sock.send_multipart(encode(P.HEARTBEAT, {}))
        assert _wait(lambda: receiver.stats().get("curve_key_revoked_messages", 0) >= 1)
        b.sock.send_multipart(encode(P.HEARTBEAT, {}))  # b is untouched
        time.sleep(0.3)
        assert set(receiver.stats()["workers"]) == {"b"}
    finally:
        a.sock.close(linger=0)
        b.sock.close(linger=0)
        receiver.close()
        ctx.term()


def test_the_weight_channel_refuses_a_revoked_key_from_then_on(tmp_path, pool_keys):
    """The zmq weight broadcaster reads the same watched allow-list: a receiver whose key left it gets no further
    version (its requests refused and counted), a listed one goes on."""
    import torch

    from asyncrl.weights import ZmqWeightBroadcaster, ZmqWeightReceiver

    public, secret = pool_keys
    keys_file = tmp_path / "allowed"
    (a_public, a_secret), (b_public, b_secret) = generate_curve_keys(), generate_curve_keys()
    write_allow_list(keys_file, [a_public, b_public])
    broadcaster = ZmqWeightBroadcaster("tcp://127.0.0.1:0", security=TransportConfig(
        curve_secret_key=secret, curve_public_key=public, curve_allowed_keys_file=str(keys_file)))
    receivers = [ZmqWeightReceiver(broadcaster.address, receiver_id=name, server_key=public, timeout_s=5.0,
                                   security=TransportConfig(curve_client_secret_key=key))
                 for name, key in (("a", a_secret), ("b", b_secret))]
    try:
        broadcaster.publish({"w": torch.zeros(64)}, 1)
        for r in receivers:
            r.start()
            assert r.wait(1, 10) is not None
        write_allow_list(keys_file, [b_public])  # a died: revoked
        broadcaster.publish({"w": torch.ones(64)}, 2)
        assert receivers[1].wait(2, 10) is not None
        assert receivers[0].wait(2, 3) is None
        assert broadcaster.stats().get("curve_key_revoked_messages", 0) >= 1, broadcaster.stats()
    finally:
        for r in receivers:
            r.close()
        broadcaster.close()
