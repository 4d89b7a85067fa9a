"""Streaming workers (worker.streaming) as real processes on loopback: the pool grants a streaming worker each
free credit at once (a static one tops up in halves), keeps statuses up to MAX_STATUS_KEYS, a streaming worker
answers SHUTDOWN and exits with its parent while groups are in flight, and what it had in flight is re-issued."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.pool.admission import MAX_STATUS_KEYS, WITHHELD
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.transport import setup_rollout_sender
from asyncrl.transport.zmq import ZmqRolloutReceiver
from tests.integration.test_lifeline import ENV, _alive, _parent, _wait_gone

pytestmark = pytest.mark.integration

TRANSPORT = TransportConfig(heartbeat_s=0.1, peer_timeout_s=5.0)
SLOW = ("--set", "worker.streaming=true", "--set", "worker.slots=2", "--set", "worker.engine.seconds_per_token=0.05",
        "--set", "worker.engine.min_new_tokens=100", "--set", "worker.engine.max_new_tokens=120",
        "--set", "transport.heartbeat_s=0.2")
"""A streaming worker whose groups take 5-6 s each: whatever happens in the first seconds happens in flight."""


def _until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _take(sender, n: int) -> list:
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += sender.take_leases(n - len(got), timeout=0.2)
    return got


@pytest.fixture()
def pool_end():
    pool = RolloutPool(PromptLedger(64), group_size=1, capacity=64, max_prompt_failures=None)
    pool.start_epoch(0)
    receiver = ZmqRolloutReceiver(TRANSPORT, pool, lambda i: {"prompt_ids": [i + 1]})
    endpoint = receiver.start()
    yield pool, receiver, endpoint
    receiver.close()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_streaming_worker_gets_each_free_credit_at_once_a_static_one_in_halves(pool_end, streaming):
    pool, _, endpoint = pool_end
    sender = setup_rollout_sender(TRANSPORT, [endpoint], worker_id=f"w-{streaming}", slots=4, streaming=streaming)
    sender.start()
    try:
        held = _take(sender, 4)
        assert len(held) == 4
        sender.send_failed(held[0], "freed one slot")  # one credit back (a failure frees it like a group)
        _until(lambda: pool.outstanding()[sender.worker_id] <= 3 + int(streaming), 10, "the pool to see the slot free")
        if streaming:  # refilled at once, before any other slot frees
            assert len(_take(sender, 1)) == 1
        else:  # held 3 of 4: no top-up until half the credits are free, then both at once
            sender.send_failed(held[1], "freed a second slot")
            refill = []
            while not refill:
                refill = sender.take_leases(4, timeout=10)
            assert len(refill) == 2
    finally:
        sender.close()


@pytest.mark.parametrize("why", ["window", "capacity"])
def test_the_pool_counts_the_seconds_it_withholds_a_workers_free_credits_and_why(why):
    """A worker holding 2 of its 4 credits, the pool bound by its staleness window (2 groups a step, k = 0) or by its
    capacity (2): the pool counts the time under that cause alone, in the worker's entry of its stats."""
    bound = dict(capacity=64, max_staleness=0, groups_per_step=2) if why == "window" else dict(capacity=2)
    pool = RolloutPool(PromptLedger(64), group_size=1, max_prompt_failures=None, **bound)
    pool.start_epoch(0)
    receiver = ZmqRolloutReceiver(TRANSPORT, pool, lambda i: {"prompt_ids": [i + 1]})
    sender = setup_rollout_sender(TRANSPORT, [receiver.start()], worker_id=f"w-{why}", slots=4, streaming=True)
    sender.start()
    try:
        assert len(_take(sender, 2)) == 2
        withheld = lambda: receiver.stats()["workers"][sender.worker_id]  # noqa: E731
        _until(lambda: withheld()[f"credits_withheld_{why}_s"] >= 0.3, 10, f"0.3 s withheld at the {why}")
        assert sender.take_leases(4, timeout=0.1) == []  # none granted meanwhile
        others = {k: v for k, v in withheld().items() if k.startswith("credits_withheld_") and why not in k}
        assert set(others) == {f"credits_withheld_{w}_s" for w in WITHHELD} - {f"credits_withheld_{why}_s"}
        assert not any(others.values()), others
    finally:
        sender.close()
        receiver.close()


def test_the_pool_keeps_a_worker_status_of_up_to_max_status_keys(pool_end):
    _, receiver, endpoint = pool_end
    sender = setup_rollout_sender(TRANSPORT, [endpoint], worker_id="w-status", slots=1)
    sender.start()
    try:
        sender.status = {f"k{i}": i for i in range(MAX_STATUS_KEYS)}
        _until(lambda: len(receiver.stats()["workers"]["w-status"]) >= MAX_STATUS_KEYS, 10, "the status")
        sender.status = {f"big{i}": i for i in range(MAX_STATUS_KEYS + 1)}  # one too many: ignored, counted
        _until(lambda: receiver.stats().get("statuses_refused", 0) >= 2, 10, "the refusals")
        stats = receiver.stats()
        workers = stats["workers"]["w-status"]
        assert "big0" not in workers and workers[f"k{MAX_STATUS_KEYS - 1}"] == MAX_STATUS_KEYS - 1
        assert any(who == "w-status" and f"{MAX_STATUS_KEYS + 1} keys" in e for who, e in stats["recent_errors"])
    finally:
        sender.close()


def _loader(n: int) -> RolloutLoader:
    config = LoaderConfig(group_size=2, batch_size=2, capacity=8, max_staleness=None, num_workers=0,
                          wait_timeout_s=60, poll_timeout_s=0.2, transport=TransportConfig(heartbeat_s=0.2,
                                                                                          peer_timeout_s=2.0),
                          worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8)))
    return RolloutLoader([{"prompt_ids": [i + 1, 2]} for i in range(n)], config)


def _in_flight(loader: RolloutLoader, worker_id: str) -> bool:
    return bool(loader.pool.outstanding()[worker_id])


def test_shutdown_with_groups_in_flight_ends_a_streaming_worker():
    loader = _loader(16)
    loader.pool.start_epoch(0)  # leases flow; nobody needs to consume them
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "worker", "--connect", loader.endpoint,
                             "--worker-id", "stream-1", *SLOW], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: _in_flight(loader, "stream-1"), 60, "leases in the streaming worker")
        assert not loader.stats()["pool"].get("groups_received", 0)
    except Exception:
        proc.kill()
        raise
    finally:
        t0 = time.monotonic()
        loader.close()  # SHUTDOWN while the worker's groups are still decoding
    try:
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert time.monotonic() - t0 < 20


def test_a_streaming_worker_exits_with_its_killed_parent_and_its_groups_in_flight_are_reissued():
    loader = _loader(16)
    loader.pool.start_epoch(0)
    argv = [sys.executable, "-m", "workers", "--worker-id", "orphan-s", "--parent-pid", "{ppid}",
            "--connect", loader.endpoint, *SLOW]
    parent, worker = _parent(argv)
    try:
        _until(lambda: _in_flight(loader, "orphan-s"), 60, "leases in the streaming worker")
        parent.kill()
        parent.wait()
        _wait_gone(worker, deadline_s=20)
        # its leases go back to the ledger (BYE, or silence past peer_timeout_s) and nothing of it was received
        _until(lambda: not _in_flight(loader, "orphan-s"), 20, "the dead worker's leases to be re-queued")
        assert not loader.stats()["pool"].get("groups_received", 0)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        loader.close()
