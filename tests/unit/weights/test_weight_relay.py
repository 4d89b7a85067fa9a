"""The node relay's pure parts, in one process, with shared memory only (no socket, no process).

* A re-serve under a bucket plan keeps the trainer's checksums end to end: a bucket that hashes otherwise is never
  staged downstream.
* The relay directory: one relay per directory, its lock is the liveness signal, a stale heartbeat reads as down.
* :class:`RelayedWeightReceiver` switches paths: relay -> direct when the relay dies (a half-written version on the
  relay is never staged), direct -> relay once a replacement serves the worker's version; commits go to the receiver
  a version came from and the other adopts it.

The "relay" here is the relay directory driven by hand (the lock, ``relay.json``, a ``ShmWeightBroadcaster`` writing
into it) and the "broadcaster" of the direct path another ``ShmWeightBroadcaster``: the path logic is backend-neutral.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config import RelayConfig, WeightSyncConfig
from asyncrl.weights import WeightSyncError
from asyncrl.weights import _relay_dir as rd
from asyncrl.weights._staging import StagingArea, plan_publish
from asyncrl.weights.base import WeightUpdate, plan_buckets
from asyncrl.weights.relayed import RelayedWeightReceiver
from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver
from tests.weights_utils import KB, is_version, weights

WAIT_S = 20.0


def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def verified_plan(tensors: dict[str, torch.Tensor]):
    """The plan a zmq receiver hands a relay: the buckets with the checksums they were verified against."""
    from asyncrl.weights._checksum import fill_bucket

    plan = plan_buckets(tensors, 16 * KB)
    for b in plan:
        b.checksum = fill_bucket(b, tensors, torch.empty(b.nbytes, dtype=torch.uint8))
    return plan


# -- re-serving under a plan ---------------------------------------------------------------------------------------
def test_a_plan_must_hold_exactly_the_tensors():
    plan = verified_plan(weights(1))
    other = {**weights(1), "w0": torch.zeros(4 * KB, dtype=torch.float16)}
    with pytest.raises(ValueError, match="w0"):
        plan_publish(other, 1, None, "full", None, 16 * KB, plan)
    copies = plan_publish(weights(1), 1, None, "full", None, 1 << 30, plan)  # bucket_bytes ignored: the plan wins
    assert [(b.nbytes, b.checksum) for b in copies] == [(b.nbytes, b.checksum) for b in plan]
    assert all(c is not b for c, b in zip(copies, plan))


def test_reserved_version_carries_the_plans_checksums_and_a_mismatch_is_never_staged(tmp_path):
    b = ShmWeightBroadcaster(tmp_path / "relay", bucket_bytes=1 << 30)  # its own plan would be one bucket
    r = ShmWeightReceiver(tmp_path / "relay", receiver_id="w0")
    r.start()
    try:
        plan = verified_plan(weights(1))
        b.publish(weights(1), 1, plan=plan)
        got = r.wait(1, WAIT_S)
        assert got is not None and is_version(got.tensors, 1) and got.metadata["buckets"] == len(plan)
        r.commit(1)
        bad = verified_plan(weights(2))
        bad[3].checksum ^= 1  # what the relay verified is not what it would serve
        with pytest.raises(WeightSyncError, match="bucket 3"):
            b.publish(weights(2), 2, plan=bad)
        eventually(lambda: r.stats()["failures"] >= 1, "the receiver to fail the torn version")
        assert r.poll() is None and r.committed_version == 1
        b.publish(weights(3), 3, plan=verified_plan(weights(3)))
        got = r.wait(3, WAIT_S)
        assert got is not None and is_version(got.tensors, 3)
    finally:
        r.close()
        b.close()


# -- adopt ---------------------------------------------------------------------------------------------------------
def test_adopt_drops_what_is_not_newer_and_counts_no_commit():
    s = StagingArea("w")
    released = []
    s.stage(WeightUpdate(version=2, mode="full", tensors={}, incarnation="a"), release=lambda: released.append(2))
    s.adopt(3, "a")  # applied from the other path: v2 is older, its hold goes
    assert released == [2] and s.poll() is None and not s.is_newer(3, "a") and s.is_newer(4, "a")
    s.stage(WeightUpdate(version=9, mode="full", tensors={}, incarnation="old"), release=lambda: released.append(9))
    s.adopt(4, "a")  # another incarnation's staged version is taken as older than what the trainer just sent
    assert released == [2, 9] and s.poll() is None
    s.adopt(1, "a")  # not newer: ignored
    stats = s.stats()
    assert stats["committed_version"] == 4 and stats["versions_committed"] == 0 and stats["versions_adopted"] == 2


# -- the relay directory -----------------------------------------------------------------------------------------------
def test_the_lock_is_the_relays_life_and_a_second_relay_is_refused(tmp_path):
    d = tmp_path / "node"
    assert rd.look(d).reason.startswith("no live relay")
    fd = rd.hold(d, 0.1)
    try:
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        assert not rd.look(d).up  # locked, but it has not said what it serves
        rd.write_info(d, {"relay_id": "r1", "pid": os.getpid(), "version": 3, "incarnation": "x"})
        view = rd.look(d)
        assert view.up and view.served == (3, "x")
        with pytest.raises(rd.RelayBusy, match="r1"):
            rd.hold(d, 0.05)
        assert not rd.look(d, stale_s=-1).up  # a heartbeat older than stale_s: hung
    finally:
        os.close(fd)
    assert not rd.look(d).up  # the lock went with its holder, relay.json left behind or not
    fd = rd.hold(d, 0.1)  # the replacement
    (d / "a-slot0-1.seg").write_bytes(b"x")
    (d / "committed-w0.json").write_bytes(b"{}")
    assert sorted(rd.sweep(d)) == ["a-slot0-1.seg", "relay.json"]
    assert (d / "committed-w0.json").exists()
    os.close(fd)


# -- RelayedWeightReceiver -----------------------------------------------------------------------------------------
class FakeRelay:
    """A relay driven by hand: the directory's lock and relay.json, and a shm broadcaster writing into it."""

    def __init__(self, directory: Path, relay_id: str = "relay"):
        self.directory, self.relay_id = directory, relay_id
        self.fd = rd.hold(directory, 1.0)
        rd.sweep(directory)
        self.b = ShmWeightBroadcaster(directory, bucket_bytes=16 * KB, slot_wait_s=0.2)
        self.served: int | None = None
        self.info()

    def info(self) -> None:
        rd.write_info(self.directory, {"relay_id": self.relay_id, "pid": os.getpid(), "serve": "shm",
                                       "address": str(self.directory), "version": self.served, "incarnation": "",
                                       "started": id(self)})

    def serve(self, version: int) -> None:
        self.b.publish(weights(version), version)
        self.served = version
        self.info()

    def die(self) -> None:
        """What a SIGKILL leaves: the lock released, relay.json and the segments where they were."""
        os.close(self.fd)


@pytest.fixture
def node(tmp_path) -> Iterator[tuple[Path, ShmWeightBroadcaster, Callable[..., RelayedWeightReceiver]]]:
    direct_b = ShmWeightBroadcaster(tmp_path / "trainer", bucket_bytes=16 * KB)
    opened: list = []

    def receiver(name: str) -> RelayedWeightReceiver:
        r = RelayedWeightReceiver(tmp_path / "node", receiver_id=name,
                                  direct=lambda: ShmWeightReceiver(tmp_path / "trainer", receiver_id=name))
        opened.append(r)
        r.start()
        return r

    yield tmp_path / "node", direct_b, receiver
    for r in opened:
        r.close()
    direct_b.close()


def apply(r: RelayedWeightReceiver, version: int) -> str:
    """The worker's safe point: waits for ``version``, checks it, commits it; returns the path it came by."""
    u = r.wait(version, WAIT_S)
    assert u is not None, r.stats()
    assert u.version == version and is_version(u.tensors, version)
    before = r.stats()
    r.commit(version)
    after = r.stats()
    return "relay" if after["versions_via_relay"] > before["versions_via_relay"] else "direct"


def test_relay_then_direct_while_it_is_dead_then_back_on_the_replacement(node):
    directory, trainer, receiver = node
    relay = FakeRelay(directory)
    trainer.publish(weights(1), 1)
    relay.serve(1)
    w = receiver("w0")
    assert w.path == "relay" and apply(w, 1) == "relay"
    assert (directory / "committed-w0.json").exists()  # phase two reported to the relay, as to any broadcaster
    relay.die()
    eventually(lambda: w.path == "direct", "the fallback to the direct path")
    trainer.publish(weights(2), 2)
    assert apply(w, 2) == "direct"
    assert w.poll() is None  # the direct receiver adopted nothing older; nothing is offered twice
    replacement = FakeRelay(directory, "relay")
    eventually(lambda: w.path == "both", "the replacement to be opened")
    replacement.serve(1)  # behind the worker: it stays on the direct path too
    time.sleep(0.2)
    assert w.path == "both" and w.poll() is None
    trainer.publish(weights(3), 3)
    assert apply(w, 3) == "direct"
    replacement.serve(3)
    eventually(lambda: w.path == "relay", "the return to the relay once it serves the worker's version")
    trainer.publish(weights(4), 4)  # the direct path is closed: only the relay brings 4
    time.sleep(0.2)
    assert w.poll() is None
    replacement.serve(4)
    assert apply(w, 4) == "relay"
    s = w.stats()
    assert (s["relay_fallbacks"], s["relay_returns"], s["versions_via_relay"], s["versions_via_direct"]) == (1, 1, 2, 2)
    assert s["failures"] == 0 and s["committed_version"] == 4
    replacement.b.close()
    replacement.die()
    relay.b.close()


def test_a_relay_killed_mid_write_stages_nothing_and_the_next_version_comes_direct(node):
    directory, trainer, receiver = node
    relay = FakeRelay(directory)
    trainer.publish(weights(1), 1)
    relay.serve(1)
    w = receiver("w0")
    assert apply(w, 1) == "relay"
    written, release = threading.Event(), threading.Event()
    real = relay.b._fill

    def stalled(bucket, tensors, out):  # the relay "dies" after writing 3 of 8 buckets of version 2
        if bucket.index == 3:
            written.set()
            release.wait(WAIT_S)
            raise SystemExit  # the writer never finishes: what a SIGKILL mid-write leaves behind
        return real(bucket, tensors, out)

    relay.b._fill = stalled
    writer = threading.Thread(target=lambda: _quietly(relay.b.publish, weights(2), 2), daemon=True)
    writer.start()
    assert written.wait(WAIT_S)
    eventually(lambda: (w.stats().get("relay") or {}).get("bytes_received", 0) >= 3 * 16 * KB,
               "the worker to verify the written buckets")
    relay.die()  # the lock goes while the segment says WRITING, 3 of 8 buckets written
    eventually(lambda: w.path == "direct", "the fallback")
    time.sleep(0.2)
    assert w.poll() is None and w.committed_version == 1  # nothing of the relay's version 2 was staged
    assert w.stats()["versions_via_relay"] == 1
    release.set()
    writer.join(WAIT_S)
    trainer.publish(weights(3), 3)  # the next version reaches the worker anyway
    assert apply(w, 3) == "direct"
    relay.b.close()


def test_an_update_being_applied_stays_valid_when_its_relay_goes_down(node):
    directory, trainer, receiver = node
    relay = FakeRelay(directory)
    relay.serve(1)
    trainer.publish(weights(1), 1)
    w = receiver("w0")
    u = w.wait(1, WAIT_S)  # handed to the engine, which is "still copying" it
    relay.die()
    eventually(lambda: w.path == "direct", "the fallback")
    assert is_version(u.tensors, 1)
    w.commit(1)  # goes to the relay receiver the update came from (closed only now), and the direct one adopts it
    assert w.poll() is None and w.stats()["versions_via_relay"] == 1
    relay.b.close()


def test_commit_of_a_version_not_handed_out_is_refused(node):
    directory, trainer, receiver = node
    relay = FakeRelay(directory)
    relay.serve(1)
    w = receiver("w0")
    with pytest.raises(ValueError, match="not handed out"):
        w.commit(1)
    relay.b.close()
    relay.die()


def test_no_relay_and_no_direct_path_fails_start(tmp_path):
    r = RelayedWeightReceiver(tmp_path / "node", receiver_id="w0",
                              direct=lambda: ShmWeightReceiver(tmp_path / "missing", receiver_id="w0"))
    with pytest.raises(WeightSyncError, match="does not exist"):
        r.start()
    r.close()


# -- config --------------------------------------------------------------------------------------------------------
def test_config_checks_name_the_fix():
    with pytest.raises(ValueError, match="weights.type='zmq'"):
        WeightSyncConfig(type="shm", relay="/dev/shm/r")
    WeightSyncConfig(type="zmq", address="tcp://h:1", relay="/dev/shm/r", shadow=True)  # shadow: the relay is shm
    with pytest.raises(ValueError, match="serve cuda_ipc"):
        RelayConfig(connect="tcp://h:1", directory="/d", device="cuda:0")
    with pytest.raises(ValueError, match="max_restarts"):
        RelayConfig(max_restarts=-1)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except (SystemExit, Exception):
        pass
