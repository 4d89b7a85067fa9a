"""The collective weight backend (``weights.type: nccl``) over gloo, end to end with real receiver processes.

The broadcaster lives in the test process; receivers are ``_nccl_driver.py`` processes (or threads, for the
in-process cases). What is checked: every receiver stages bit-exact weights; a late joiner gets its first
full copy point-to-point in a re-formed group; a receiver SIGKILLed mid-transfer fails that generation, the
survivors discard the version in flight (counted), re-form without it and stage the version; a corrupted
bucket is refused by its checksum and healed by a retry; the rendezvous refuses a non-loopback bind
without CURVE and an unlisted CURVE key; malformed control messages are counted, not fatal.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
import zmq

from asyncrl.weights._staging import tensor_bytes
from asyncrl.weights.base import WeightSyncError
from asyncrl.weights.nccl import NcclWeightBroadcaster, NcclWeightReceiver
from tests.integration.test_weights_processes import Driver, assert_eventually

pytestmark = pytest.mark.integration

DRIVER = "tests/integration/_nccl_driver.py"
MB = 1 << 20
TIMEOUT_S = 120.0


def crcs(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: zlib.crc32(tensor_bytes(t)) for name, t in tensors.items()}


def state(seed: int, layers: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.mlp.weight": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(layers)}
    return {**out, "embed.weight": torch.randn(256, 1024, generator=g), "step": torch.tensor(seed)}


class NcclDriver(Driver):
    """One ``_nccl_driver.py`` receiver process (events as :class:`Driver`'s)."""

    def __init__(self, address: str, receiver_id: str, log, *extra: str, versions: str = "1,2"):
        argv = [sys.executable, DRIVER, address, receiver_id, "--versions", versions, *extra]
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        self.events: list[dict] = []
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()


@pytest.fixture
def broadcaster():
    b = NcclWeightBroadcaster(bucket_bytes=MB, peer_timeout_s=2.0, op_timeout_s=20.0, form_timeout_s=10.0)
    yield b
    b.close()


def test_group_of_processes_with_a_late_joiner(broadcaster, tmp_path):
    b, deadline = broadcaster, time.monotonic() + TIMEOUT_S
    drivers = []
    try:
        v1 = state(1)
        b.publish(v1, 1)
        drivers = [NcclDriver(b.address, f"r{i}", tmp_path / f"r{i}.log") for i in range(2)]
        for d in drivers:
            assert d.until("staged", deadline, version=1)["checksums"] == crcs(v1)
            d.until("committed", deadline, version=1)
        assert_eventually(lambda: b.committed() == {"r0": 1, "r1": 1}, deadline)

        late = NcclDriver(b.address, "late", tmp_path / "late.log", versions="1,2")
        drivers.append(late)
        assert late.until("staged", deadline, version=1)["checksums"] == crcs(v1)  # its first full copy
        late.until("committed", deadline, version=1)
        assert_eventually(lambda: b.members() == ["late", "r0", "r1"], deadline)
        p2p_before = b.stats().get("jobs_p2p", 0)
        assert p2p_before >= 1  # the late joiner's copy went point-to-point, not to everyone again

        v2 = state(2)
        b.publish(v2, 2)
        for d in drivers:
            assert d.until("staged", deadline, version=2)["checksums"] == crcs(v2)
            d.until("committed", deadline, version=2)
            assert d.until("stats", deadline)["failures"] == 0
            assert d.proc.wait(20) == 0, d.log.read_text()[-2000:]
        stats = b.stats()
        assert stats["jobs_broadcast"] >= 2 and stats["generation_aborts"] == 0 and stats["bad_messages"] == 0
        assert_eventually(lambda: b.committed() == {"r0": 2, "r1": 2, "late": 2}, deadline)
    finally:
        for d in drivers:
            d.stop()


@pytest.mark.slow
def test_receiver_killed_mid_transfer_survivors_reform(broadcaster, tmp_path):
    """A member SIGKILLed mid-broadcast: the broadcaster's collective fails at once (connection reset), it
    dissolves the generation (survivors' pending receive fails as its group closes), the survivors count one
    failure, nothing of version 2 was staged by anyone before that, the next generation forms without the
    victim (dropped after peer_timeout_s) and version 2 reaches both survivors bit for bit."""
    b, deadline = broadcaster, time.monotonic() + TIMEOUT_S
    drivers = []
    try:
        b.publish({"w": torch.ones(16)}, 1)
        drivers = [NcclDriver(b.address, rid, tmp_path / f"{rid}.log", *extra)
                   for rid, extra in (("s0", ()), ("s1", ()), ("victim", ("--delay", "0.05")))]
        for d in drivers:
            d.until("committed", deadline, version=1)
        assert_eventually(lambda: len(b.members()) == 3, deadline)
        survivors, victim = drivers[:2], drivers[2]

        v2 = {f"layers.{i}": torch.randn(256, 1024) for i in range(48)}  # 48 MiB in 48 buckets
        b.publish(v2, 2)
        progress = victim.until("progress", deadline, version=2)
        while progress["bytes"] < 4 * MB:
            progress = victim.until("progress", deadline, version=2)
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.wait(10) == -signal.SIGKILL

        for d in survivors:
            assert d.until("staged", deadline, version=2)["checksums"] == crcs(v2)
            d.until("committed", deadline, version=2)
            stats = d.until("stats", deadline)
            assert stats["failures"] == 1, stats  # the aborted transfer, counted
            assert "failed in generation" in stats["recent_failures"][0]
        stats = b.stats()
        assert stats["generation_aborts"] == 1 and stats["members_dropped"] >= 1, stats
        assert b.members() == [] or "victim" not in b.members()
        assert b.committed()["victim"] == 1  # never reached phase two of version 2
        assert b.committed()["s0"] == b.committed()["s1"] == 2
    finally:
        for d in drivers:
            d.stop()


class CorruptingBroadcaster(NcclWeightBroadcaster):
    """Flips one byte of bucket ``index`` for the first job only (after its checksum was taken)."""

    corrupt_index = 1

    def _job(self, gen, entry, to):
        if self.corrupt_index is None:
            return super()._job(gen, entry, to)
        buf, self.corrupt_index = entry.buffers[self.corrupt_index], None
        buf[7] ^= 0xFF
        try:
            return super()._job(gen, entry, to)
        finally:
            buf[7] ^= 0xFF


def test_corrupt_bucket_refused_by_checksum_and_healed():
    b = CorruptingBroadcaster(bucket_bytes=MB, peer_timeout_s=2.0)
    r = NcclWeightReceiver(b.address, receiver_id="r", timeout_s=20)
    try:
        v1 = state(3, layers=4)
        b.publish(v1, 1)
        r.start()
        update = r.wait(1, 20)  # the first copy fails its checksum; the retry (p2p, after RETRY_S) is clean
        assert update is not None, r.stats()
        assert crcs(update.tensors) == crcs(v1)
        stats = r.stats()
        assert stats["failures"] == 1 and "checksum" in stats["recent_failures"][0]["reason"], stats
        r.commit(1)
        assert_eventually(lambda: b.stats()["receiver_failures"] == 1 and b.committed() == {"r": 1},
                          time.monotonic() + 10)
    finally:
        r.close()
        b.close()


def test_non_loopback_rendezvous_needs_curve():
    with pytest.raises(ValueError, match="beyond loopback without authentication"):
        NcclWeightBroadcaster("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="curve_allowed_keys"):
        public, secret = zmq.curve_keypair()
        NcclWeightBroadcaster("tcp://0.0.0.0:0", curve_secret_key=secret.decode(), curve_public_key=public.decode())


def test_curve_admits_listed_keys_only():
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    worker_public, worker_secret = (k.decode() for k in zmq.curve_keypair())
    _, stranger_secret = (k.decode() for k in zmq.curve_keypair())
    b = NcclWeightBroadcaster(curve_secret_key=server_secret, curve_public_key=server_public,
                              curve_allowed_keys=[worker_public], peer_timeout_s=2.0)
    good = NcclWeightReceiver(b.address, receiver_id="good", curve_server_key=server_public,
                              curve_secret_key=worker_secret, timeout_s=20)
    bad = NcclWeightReceiver(b.address, receiver_id="bad", curve_server_key=server_public,
                             curve_secret_key=stranger_secret, timeout_s=1.5)
    try:
        v1 = {"w": torch.arange(64.0)}
        b.publish(v1, 1)
        good.start()
        update = good.wait(1, 20)
        assert update is not None and torch.equal(update.tensors["w"], v1["w"])
        with pytest.raises(WeightSyncError, match="not admitted"):
            bad.start()
        assert b.stats()["receivers"] == ["good"] and b.stats().get("curve_keys_refused", 0) >= 1
    finally:
        good.close()
        b.close()


def test_malformed_control_messages_are_counted():
    b = NcclWeightBroadcaster(peer_timeout_s=2.0)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        rogue.connect(b.address)
        from asyncrl.codec import encode

        rogue.send(b"garbage")
        rogue.send_multipart(encode("n_store", {"id": 1, "op": "get", "key": "k", "value": b""}))  # never said HELLO
        rogue.send_multipart(encode("n_hello", {"receiver_id": "../etc"}))
        assert_eventually(lambda: b.stats()["bad_messages"] == 3, time.monotonic() + 10)
        b.publish({"w": torch.ones(4)}, 1)  # still serving
        r = NcclWeightReceiver(b.address, receiver_id="r", timeout_s=20)
        r.start()
        assert r.wait(1, 20) is not None
        r.close()
    finally:
        rogue.close()
        ctx.term()
        b.close()
