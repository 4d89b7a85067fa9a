"""Double buffering, hostile readers and checksums of the shm and zmq weight backends, in one process.

A version published while a receiver still reads (or applies) the previous one corrupts neither: the
reader's views keep version v's bytes while v+1 and v+2 are published, and what any receiver stages
is exactly one published version.
"""

from __future__ import annotations

import time

import pytest

from asyncrl.weights import setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights.shm import ShmWeightReceiver
from asyncrl.weights.zmq import ZmqWeightReceiver
from tests.weights_utils import KB, corrupt_next, is_version, weights

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

WAIT_S = 20.0


@pytest.fixture(params=["shm", "zmq"])
def backend(request):
    kw = {"slot_wait_s": 0.2} if request.param == "shm" else {}
    b = setup_weight_broadcaster(request.param, bucket_bytes=16 * KB, **kw)
    opened = [b]

    def receiver(name: str, cls_kw: dict | None = None):
        r = setup_weight_receiver(request.param, b.address, receiver_id=name, **(cls_kw or {}))
        opened.append(r)
        r.start()
        return r

    yield request.param, b, receiver
    for obj in reversed(opened):
        obj.close()


def test_a_reader_holding_v_keeps_it_while_v1_and_v2_are_published(backend):
    name, b, receiver = backend
    holder = receiver("holder")
    b.publish(weights(1), 1)
    held = holder.wait(1, WAIT_S)  # handed out: the engine is "applying" it and never commits
    assert held is not None and is_version(held.tensors, 1)
    b.publish(weights(2), 2)
    b.publish(weights(3), 3)  # shm: lands in version 1's slot, still held -> a fresh segment after slot_wait_s
    late = receiver("late")
    update = late.wait(3, WAIT_S)
    assert update is not None and is_version(update.tensors, 3)
    assert is_version(held.tensors, 1), "version 1's views changed under the reader"
    newest = holder.wait(3, WAIT_S)
    assert newest is not None and is_version(newest.tensors, 3)
    if name == "shm":
        assert b.stats()["slots_replaced"] == 1
    holder.commit(3)
    late.commit(3)
    b.publish(weights(4), 4)  # slots are free again: reused, not replaced
    assert late.wait(4, WAIT_S) is not None and is_version(late.poll().tensors, 4)
    if name == "shm":
        assert b.stats()["slots_replaced"] == 1


def test_a_slow_reader_mid_transfer_stages_only_whole_versions(backend, monkeypatch):
    name, b, receiver = backend
    cls, step = (ShmWeightReceiver, "_verify_bucket") if name == "shm" else (ZmqWeightReceiver, "_receive_bucket")
    real = getattr(cls, step)

    def slow(self, *args):
        if self.receiver_id == "slow":
            time.sleep(0.03)
        return real(self, *args)

    monkeypatch.setattr(cls, step, slow)
    fast, slow_r = receiver("fast"), receiver("slow", {"window": 1} if name == "zmq" else {})
    b.publish(weights(1), 1)
    deadline = time.monotonic() + WAIT_S
    while slow_r.stats().get("bytes_received", 0) == 0:  # the slow one is inside version 1
        assert time.monotonic() < deadline
        time.sleep(0.002)
    b.publish(weights(2), 2)
    b.publish(weights(3), 3)
    for r in (fast, slow_r):
        update = r.wait(3, WAIT_S)
        assert update is not None and is_version(update.tensors, 3), r.stats()
    for r in (fast, slow_r):  # zmq: a version retired mid-transfer is GONE (counted); nothing else failed
        assert all("is gone" in f["reason"] for f in r.stats()["recent_failures"]), r.stats()["recent_failures"]


def test_checksum_mismatch_is_refused_and_counted(backend):
    _, b, receiver = backend
    r = receiver("r0")
    b.publish(weights(1), 1)
    r.commit(r.wait(1, WAIT_S).version)
    corrupt_next(b, 5)
    b.publish(weights(2), 2)
    deadline = time.monotonic() + WAIT_S
    while r.stats().get("checksum_mismatches", 0) < 1:
        assert time.monotonic() < deadline, r.stats()
        time.sleep(0.01)
    assert r.poll() is None and r.stats()["committed_version"] == 1
    assert "checksum mismatch in bucket 5 of version 2" in r.stats()["recent_failures"][0]["reason"]
    b.publish(weights(3), 3)
    update = r.wait(3, WAIT_S)
    assert update is not None and is_version(update.tensors, 3)


def test_a_publish_that_dies_midway_is_never_staged(backend):
    """The trainer raises while writing bucket 5 of version 2 (after receivers started fetching it): receivers
    count a failure and keep version 1; version 3 gets through."""
    name, b, receiver = backend
    r = receiver("r0")
    b.publish(weights(1), 1)
    r.commit(r.wait(1, WAIT_S).version)
    real = b._fill

    def dying(bucket, tensors, out):
        if bucket.index == 5:
            raise RuntimeError("trainer died mid-publish")
        return real(bucket, tensors, out)

    b._fill = dying
    with pytest.raises(RuntimeError, match="mid-publish"):
        b.publish(weights(2), 2)
    b._fill = real
    deadline = time.monotonic() + (WAIT_S if name == "shm" else 0.5)  # zmq: a receiver may never have seen it
    while r.stats()["failures"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    if name == "shm":  # latest.json names the failed segment: every reader counts it
        assert r.stats()["failures"] >= 1 and "failed while publishing" in r.stats()["recent_failures"][0]["reason"]
    assert r.poll() is None and r.stats()["committed_version"] == 1 and r.stats()["versions_staged"] == 1
    b.publish(weights(3), 3)
    update = r.wait(3, WAIT_S)
    assert update is not None and is_version(update.tensors, 3)
