"""The control plane at scale, over real sockets: a pool whose staleness window is smaller than workers x slots feeds
every worker (8 and 32 simulated workers, many DEALERs in one thread: :class:`asyncrl.testing.swarm.Swarm`), a worker
that joins gets the next lease, and idle ends wait for events instead of polling.

The old grant pass walked workers in join order and stopped at the first refusal: two workers got every lease, the
others none, and a worker that joined never worked (the same swarm against that code: groups per worker 0 / 0 / all).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from asyncrl.config import GateConfig, TransportConfig
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.testing.swarm import Swarm
from asyncrl.transport import setup_rollout_sender
from asyncrl.transport.zmq import ZmqRolloutReceiver

pytestmark = pytest.mark.integration

GROUP_SIZE, BATCH_SIZE, MAX_STALENESS = 4, 8, 1
WINDOW = (MAX_STALENESS + 1) * BATCH_SIZE
"""Groups in flight the pool allows: 16, against 8 x 8 or 32 x 8 credits."""


class Trainer:
    """Takes groups and commits a step every ``BATCH_SIZE`` (a training step that costs nothing)."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool
        self.groups = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        batch: list[int] = []
        while not self.stop.is_set():
            group = self.pool.take(timeout=0.1)
            if group is None:
                continue
            self.groups += 1
            batch.append(group.prompt_index)
            if len(batch) == BATCH_SIZE:
                self.pool.commit(self.pool.ledger.epoch, batch)
                self.pool.set_policy_version(self.pool.policy_version + 1)
                batch = []

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@contextmanager
def window_pool(heartbeat_s: float = 0.5) -> Iterator[tuple[RolloutPool, ZmqRolloutReceiver, str]]:
    pool = RolloutPool(PromptLedger(100_000, shuffle=False), group_size=GROUP_SIZE, capacity=1 << 16,
                       max_staleness=MAX_STALENESS, groups_per_step=BATCH_SIZE, max_prompt_failures=None)
    pool.start_epoch(0)
    receiver = ZmqRolloutReceiver(TransportConfig(heartbeat_s=heartbeat_s, peer_timeout_s=30.0), pool,
                                  lambda i: {"prompt_ids": [1, 2, 3]}, gate=GateConfig(max_peers=64))
    endpoint = receiver.start()
    try:
        yield pool, receiver, endpoint
    finally:
        receiver.close()


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("workers", [8, 32])
def test_every_worker_gets_leases_when_the_window_is_smaller_than_workers_times_slots(workers):
    """16 groups in flight, ``workers`` x 8 credits: the leases go round, every worker generates. The run lasts until
    the trainer took 4 groups per worker (a few seconds), not a fixed time."""
    with window_pool() as (pool, receiver, endpoint):
        swarm = Swarm(endpoint, workers, slots=8, max_batch=4, group_size=GROUP_SIZE, heartbeat_s=0.5).start()
        trainer = Trainer(pool)
        try:
            _until(lambda: trainer.groups >= 4 * workers, 120, f"{4 * workers} groups")
        finally:
            trainer.close()
            swarm.close()
        groups = swarm.groups()
        assert min(groups.values()) > 0, f"workers never served: {sorted(w for w, n in groups.items() if not n)}"
        assert pool.peak["groups_in_flight"] <= WINDOW  # the window still binds: spreading leases widened nothing
        assert receiver.stats().get("bad_messages", 0) == 0


def test_a_worker_that_joins_gets_work_at_once():
    """Eight workers keep the window full; a ninth joins and gets one of the next leases (its pass starts where the
    grants are, ahead of workers that already had their turn)."""
    with window_pool() as (pool, _, endpoint):
        swarm = Swarm(endpoint, 8, slots=8, group_size=GROUP_SIZE, heartbeat_s=0.5).start()
        trainer = Trainer(pool)
        late = None
        try:
            _until(lambda: trainer.groups >= 4 * WINDOW, 120, "the first workers to fill the window")
            late = Swarm(endpoint, 1, slots=8, group_size=GROUP_SIZE, heartbeat_s=0.5, prefix="late").start()
            joined = swarm.last_lease_id()  # welcomed by now
            _until(lambda: late.first_lease_id()["late0"] is not None, 60, "the late worker's first lease")
            # counted in lease ids (the pool numbers its grants), not in groups the trainer took meanwhile: those
            # depend on when the threads run (a costless engine turns thousands of groups a second)
            granted_before = late.first_lease_id()["late0"] - joined - 1
            assert granted_before <= WINDOW, f"{granted_before} leases went to others after it joined"
            _until(lambda: late.groups()["late0"] > 0, 60, "the late worker's first group")
        finally:
            trainer.close()
            if late is not None:
                late.close()
            swarm.close()


def test_idle_ends_wait_for_events_instead_of_polling():
    """A worker connected to a pool that has nothing to lease: over ten heartbeats, both I/O threads wake about once
    per heartbeat (the worker answers the pool's), where they used to poll every 20 ms (worker) and 5 ms (pool)."""
    heartbeat_s = 0.2
    pool = RolloutPool(PromptLedger(8), group_size=GROUP_SIZE, capacity=8)  # no epoch started: nothing to lease
    receiver = ZmqRolloutReceiver(TransportConfig(heartbeat_s=heartbeat_s, peer_timeout_s=5.0), pool,
                                  lambda i: {"prompt_ids": [1]})
    transport = TransportConfig(heartbeat_s=heartbeat_s, peer_timeout_s=5.0)
    sender = setup_rollout_sender(transport, [receiver.start()], worker_id="idle", slots=4)
    sender.start()
    try:
        assert sender.take_leases(4, timeout=0.5) == []
        worker0, pool0 = sender.counters["io_wakes"], receiver.stats()["io_wakes"]
        time.sleep(10 * heartbeat_s)
        worker_wakes, pool_wakes = sender.counters["io_wakes"] - worker0, receiver.stats()["io_wakes"] - pool0
        statuses = receiver.stats()["workers"]["idle"]
    finally:
        sender.close()
        receiver.close()
    assert worker_wakes <= 2 * 10 + 5, worker_wakes  # about one: it answers the pool's heartbeat in that wake
    assert pool_wakes <= 4 * 10 + 5, pool_wakes  # its heartbeats, the worker's, housekeeping twice per heartbeat
    assert statuses["credits_withheld_no_prompt_s"] > 0  # the wait is still charged, without a grant pass per tick


def test_a_worker_started_before_its_pool_says_hello_when_the_connection_is_up_not_a_heartbeat_later(tmp_path):
    """A worker's DEALER has IMMEDIATE=1: a HELLO sent before its connection is made does not leave. It is tried again
    soon (from 5 ms, doubling up to ``heartbeat_s``), not a heartbeat later: once the I/O thread woke on events
    instead of a 20 ms tick, its first HELLO usually beat the connection, and the first batch of every run (a run's
    start, every resume, every test that builds a loader) waited one ``heartbeat_s``."""
    heartbeat_s = 60.0  # a retry a heartbeat later takes a minute, past the handshake's 20 s bound
    transport = TransportConfig(bind=f"ipc://{tmp_path}/pool.sock", heartbeat_s=heartbeat_s, peer_timeout_s=300.0,
                                handshake_timeout_s=20.0)
    pool = RolloutPool(PromptLedger(8), group_size=GROUP_SIZE, capacity=8)
    receiver = ZmqRolloutReceiver(transport, pool, lambda i: {"prompt_ids": [1]})
    late = threading.Timer(0.3, receiver.start)  # the pool binds after the worker's first HELLOs were due
    late.start()
    sender = setup_rollout_sender(transport, [transport.bind], worker_id="early", slots=4)
    try:
        sender.start()  # returns once welcomed; HandshakeTimeout after 20 s
        assert sender.counters["send_dropped_hello"] >= 1, dict(sender.counters)  # it did start too early
    finally:
        late.join()
        receiver.close()  # first: the worker answers its SHUTDOWN
        sender.close()


def test_simulated_workers_retry_a_dropped_hello_as_real_ones_do(tmp_path):
    """The swarm speaks the real protocol, including the HELLO retry above: a simulated worker's HELLO dropped before
    its connection is made is tried again from 5 ms on, not a heartbeat later (before, the benchmark's "first HELLO
    to first lease" counted that heartbeat)."""
    transport = TransportConfig(bind=f"ipc://{tmp_path}/pool.sock", heartbeat_s=60.0, peer_timeout_s=300.0)
    pool = RolloutPool(PromptLedger(64), group_size=GROUP_SIZE, capacity=64)
    pool.start_epoch(0)
    receiver = ZmqRolloutReceiver(transport, pool, lambda i: {"prompt_ids": [1]})
    late = threading.Timer(0.3, receiver.start)  # the pool binds after the swarm's first HELLOs were due
    late.start()
    swarm = Swarm(transport.bind, 4, slots=2, group_size=GROUP_SIZE, heartbeat_s=60.0)
    try:
        swarm.start(timeout=20.0)  # a retry a heartbeat later: 30-60 s, past this bound
        assert swarm.counters["send_dropped_hello"] >= 1, dict(swarm.counters)  # it did start too early
    finally:
        late.join()
        receiver.close()
        swarm.close()


@pytest.mark.extended
@pytest.mark.parametrize("workers", [8, 32])
def test_every_worker_gets_leases_over_30_seconds(workers):
    """The lease spread held for 30 s: every worker served in each half of the run."""
    with window_pool() as (pool, _, endpoint):
        swarm = Swarm(endpoint, workers, slots=8, max_batch=4, group_size=GROUP_SIZE, heartbeat_s=0.5).start()
        trainer = Trainer(pool)
        try:
            time.sleep(15)
            half = swarm.groups()
            time.sleep(15)
            end = swarm.groups()
        finally:
            trainer.close()
            swarm.close()
    assert min(half.values()) > 0 and min(end[w] - half[w] for w in end) > 0, (half, end)
