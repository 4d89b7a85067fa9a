"""The rollout channel's edges: remote workers via the CLI, ipc://, CURVE, handshake timeout,
loopback-only default, and a worker that outlives a trainer restart's silence."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.transport.zmq import ZmqRolloutReceiver, generate_curve_keys, write_curve_key_file

pytestmark = pytest.mark.integration

ASYNCRL = [sys.executable, "-m", "asyncrl.cli"]
FAST = dict(heartbeat_s=0.2, peer_timeout_s=3)


def _config(**transport) -> LoaderConfig:
    return LoaderConfig(
        group_size=2,
        batch_size=4,
        capacity=8,
        max_staleness=None,
        wait_timeout_s=60,
        transport=TransportConfig(**{**FAST, **transport}),
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8)),
    )


def _prompts(n: int) -> list[dict]:
    return [{"text": f"prompt {i}"} for i in range(n)]


def _worker(endpoint: str, *extra: str) -> subprocess.Popen:
    argv = [*ASYNCRL, "worker", "--connect", endpoint, "--set", "transport.heartbeat_s=0.2", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _epoch(loader: RolloutLoader) -> list[str]:
    return [g for batch in loader for g in batch["group_ids"]]


def test_cli_worker_serves_a_loader_started_elsewhere():
    with RolloutLoader(_prompts(24), _config()) as loader:
        proc = _worker(loader.endpoint, "--worker-id", "remote-1", "--set", "worker.slots=3")
        try:
            groups = _epoch(loader)
            workers = loader.stats()["transport"]["workers"]
        finally:
            loader.close()  # tells the worker to shut down
            proc.wait(20)
    assert sorted(groups) == sorted(f"e0-p{i}" for i in range(24))
    assert workers["remote-1"]["slots"] == 3
    assert proc.returncode == 0, proc.stderr.read()[-2000:]


def test_ipc_endpoint(tmp_path: Path):
    path = tmp_path / "pool.sock"
    with RolloutLoader(_prompts(12), _config(bind=f"ipc://{path}"), num_workers=1) as loader:
        assert loader.endpoint == f"ipc://{path}"
        assert len(_epoch(loader)) == 12


def test_curve_pool_admits_only_the_worker_keys_it_lists(tmp_path: Path):
    public, secret = generate_curve_keys()
    key_file = tmp_path / "worker.key"
    worker_public = write_curve_key_file(str(key_file))
    allowed = tmp_path / "allowed-workers"
    allowed.write_text(f"# workers allowed in\n{worker_public}\n")
    curve = dict(curve_public_key=public, curve_secret_key=secret, curve_allowed_keys_file=str(allowed))
    with RolloutLoader(_prompts(8), _config(**curve)) as loader:
        quick = ("--set", "transport.handshake_timeout_s=2")
        stranger = _worker(loader.endpoint, "--server-key", public, "--worker-id", "stranger", *quick)  # unknown key
        plain = _worker(loader.endpoint, "--worker-id", "plain", *quick)  # no CURVE at all
        keyed = _worker(loader.endpoint, "--server-key", public, "--client-key-file", str(key_file), "--worker-id", "k")
        try:
            groups = _epoch(loader)
            stranger.wait(30)
            plain.wait(30)
            stats = loader.stats()["transport"]
        finally:
            _stop(stranger)
            _stop(plain)
            loader.close()
            keyed.wait(20)
    assert sorted(groups) == sorted(f"e0-p{i}" for i in range(8))
    assert keyed.returncode == 0, keyed.stderr.read()[-2000:]
    for refused in (stranger, plain):
        assert refused.returncode != 0
        assert "transport.handshake_timeout_s" in refused.stderr.read()
    assert stats["curve_keys_refused"] >= 1 and stats["curve_keys_admitted"] >= 1
    assert stats.get("handshakes_failed_protocol", 0) + stats.get("handshakes_failed", 0) >= 1  # the plain one
    # only the listed worker ever joined, so nobody else was ever granted a lease
    assert list(stats["workers"]) == ["k"] and stats["workers_joined"] == 1


def test_curve_pool_without_an_allow_list_is_refused():
    from asyncrl.pool.buffer import RolloutPool
    from asyncrl.pool.ledger import PromptLedger

    public, secret = generate_curve_keys()
    pool = RolloutPool(PromptLedger(4), group_size=1, capacity=1)
    with pytest.raises(ValueError, match="transport.curve_allowed_keys"):
        ZmqRolloutReceiver(TransportConfig(curve_public_key=public, curve_secret_key=secret), pool, lambda i: {})
    open_door = TransportConfig(curve_public_key=public, curve_secret_key=secret, curve_allow_any_client=True)
    ZmqRolloutReceiver(open_door, pool, lambda i: {})  # the documented opt-out


def test_handshake_timeout_names_its_setting():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*ASYNCRL, "worker", "--connect", f"tcp://127.0.0.1:{port}", "--set", "transport.handshake_timeout_s=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "HandshakeTimeout" in proc.stderr and "transport.handshake_timeout_s" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_non_loopback_bind_needs_curve_or_explicit_opt_in():
    from asyncrl.pool.buffer import RolloutPool
    from asyncrl.pool.ledger import PromptLedger

    pool = RolloutPool(PromptLedger(4), group_size=1, capacity=1)
    with pytest.raises(ValueError, match="curve_secret_key"):
        ZmqRolloutReceiver(TransportConfig(bind="tcp://0.0.0.0:0"), pool, lambda i: {})
    ZmqRolloutReceiver(TransportConfig(bind="tcp://0.0.0.0:0", allow_insecure_remote=True), pool, lambda i: {})


def test_worker_gives_up_on_a_silent_pool():
    with RolloutLoader(_prompts(400), _config(peer_timeout_s=1.0)) as loader:
        proc = _worker(loader.endpoint, "--set", "transport.peer_timeout_s=1.0")
        try:
            it = iter(loader)
            next(it)
            loader.receiver.close(shutdown_workers=False)  # the pool vanishes without a word
            proc.wait(30)
        finally:
            _stop(proc)
    assert proc.returncode != 0
    assert "transport.peer_timeout_s" in proc.stderr.read()


def test_worker_serves_the_pools_that_answer():
    """A worker given a rank that already finished (nobody listening) still serves the live one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with RolloutLoader(_prompts(16), _config()) as loader:
        proc = _worker(loader.endpoint, "--connect", dead, "--set", "transport.handshake_timeout_s=2")
        try:
            groups = _epoch(loader)
        finally:
            loader.close()
            proc.wait(20)
    assert len(groups) == 16
    assert proc.returncode == 0, proc.stderr.read()[-3000:]


def test_cancel_after_a_reset_keeps_the_leases_granted_since():
    """The bad interleaving forced: the reset pool grants the new timeline's leases before its CANCEL of the
    old timeline leaves. The worker must keep them (it used to drop every queued lease, which the ledger
    then counted as held until lease_timeout_s: the stall of load_state_dict with running workers)."""
    from asyncrl.pool.buffer import RolloutPool
    from asyncrl.pool.ledger import PromptLedger
    from asyncrl.transport.zmq import ZmqRolloutSender

    pool = RolloutPool(PromptLedger(32), group_size=1, capacity=32)
    receiver = ZmqRolloutReceiver(TransportConfig(**FAST), pool, lambda i: {"prompt_ids": [i + 1]})
    pool.start_epoch(0)
    sender = ZmqRolloutSender(TransportConfig(**FAST), [receiver.start()], worker_id="w", slots=4)
    try:
        sender.start()
        old = sender.take_leases(4, timeout=10)  # the worker is busy with these
        assert old
        saved = pool.state_dict()
        with sender._cv:  # the I/O thread's queue; stop here so the new leases are still queued
            while sender._leases:
                sender._leases.popleft()
        pool.load_state_dict(saved)  # the reset: a new timeline, whose leases the receiver grants at once
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(x.lease_id >= pool.min_lease_id for x in list(sender._leases)):
            time.sleep(0.01)
        queued = {x.lease_id for x in list(sender._leases) if x.lease_id >= pool.min_lease_id}
        assert queued, "the reset pool granted no new lease"
        receiver.cancel_all()  # ... and only now the CANCEL of the old timeline
        while time.monotonic() < deadline and sender.counters["cancels_received"] == 0:
            time.sleep(0.01)
        assert sender.counters["cancels_received"] == 1
        kept = {x.lease_id for x in sender.take_leases(32, timeout=0.5)}
    finally:
        sender.close()
        receiver.close()
    assert queued <= kept, f"the worker dropped leases of the live timeline: {sorted(queued - kept)}"


def test_load_state_dict_into_a_running_loader_keeps_the_leases_granted_since():
    """The pool grants the restored timeline's leases as soon as the state is loaded, before the CANCEL of
    the old timeline reaches the workers; a CANCEL that dropped every queued lease left those held by
    nobody until lease_timeout_s (a stall in 4 of 8 ordered trials). CANCEL now names the timeline's first
    lease id and workers drop only older ones: no lease ever expires here."""
    config = dataclasses.replace(_config(), ordered=True, num_workers=2, lease_timeout_s=4.0, batch_size=2)
    with RolloutLoader(_prompts(64), config) as loader:
        it = iter(loader)
        next(it)
        for _ in range(8):
            loader.load_state_dict(loader.state_dict())
            it = iter(loader)
            next(it)
            next(it)
        stats = loader.stats()
    assert stats["transport"].get("leases_expired", 0) == 0, stats["transport"]
    assert stats["ledger"].get("requeued_expired", 0) == 0


def test_a_worker_that_reads_late_still_gets_shutdown():
    """The root cause of a missed SHUTDOWN: a worker's DEALER has IMMEDIATE=1, with which libzmq drops a
    disconnected pipe's unread messages, so a SHUTDOWN the worker had not read when the pool closed the
    connection was lost (the worker then exited with PeerLost). The pool now keeps the connection open
    until the worker's BYE (at most SHUTDOWN_ACK_S): a worker that reads late still gets it."""
    import threading

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from asyncrl.codec import decode, encode
    from asyncrl.pool.buffer import RolloutPool
    from asyncrl.pool.ledger import PromptLedger
    from asyncrl.transport import protocol as P

    pool = RolloutPool(PromptLedger(4), group_size=1, capacity=1)
    receiver = ZmqRolloutReceiver(TransportConfig(**FAST), pool, lambda i: {})
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IMMEDIATE, 1)  # as ZmqRolloutSender's
    monitor = worker.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    worker.connect(receiver.start())
    hello = {"worker_id": "late", "slots": 1, "pid": 1, "host": "h", "protocol": P.PROTOCOL_VERSION}
    worker.send_multipart(encode(P.HELLO, hello))
    assert worker.poll(10_000)
    worker.recv_multipart()  # WELCOME; the worker reads nothing more for a while
    closer = threading.Thread(target=receiver.close)
    closer.start()
    try:
        disconnected = monitor.poll(500) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        kinds = []
        while worker.poll(1000):  # the late read
            kind, _ = decode(worker.recv_multipart(copy=False), max_message_bytes=1 << 20)
            kinds.append(kind)
            if kind == P.SHUTDOWN:
                worker.send_multipart(encode(P.BYE, {}))
                break
        closer.join(10)
    finally:
        worker.disable_monitor()
        monitor.close(linger=0)
        worker.close(linger=0)
        ctx.term()
    assert not disconnected, "the pool closed the connection before the worker acknowledged SHUTDOWN"
    assert P.SHUTDOWN in kinds


def test_a_remote_worker_waiting_for_weights_takes_no_lease_and_leaves_when_its_trainer_shuts_down():
    """A worker started near the end of a run used to wait weights.wait_for_first_s for weights before it even
    greeted the pool, then handshake_timeout_s for a trainer that had gone (>= 120 s). Now it greets first, takes
    no lease while it waits (the pool grants it nothing), and the pool's SHUTDOWN ends the wait at once."""
    from asyncrl.weights import setup_weight_broadcaster

    broadcaster = setup_weight_broadcaster("zmq")  # the trainer's, which has published nothing yet
    weights = broadcaster.address
    with RolloutLoader(_prompts(8), _config()) as loader:
        it = iter(loader)  # the pool is active: it would grant leases to any ready worker
        proc = _worker(loader.endpoint, "--worker-id", "late", "--set", "worker.weights.type=zmq",
                       "--set", f"worker.weights.address={weights}", "--set", "worker.weights.wait_for_first_s=120")
        try:
            deadline = time.monotonic() + 60
            while "late" not in loader.stats()["transport"]["workers"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "late" in loader.stats()["transport"]["workers"], "the worker must greet before its weights arrive"
            time.sleep(1.0)
            assert loader.stats()["transport"].get("leases_granted", 0) == 0, "a worker without weights holds no lease"
            loader.close()  # the trainer ends: SHUTDOWN
            started = time.monotonic()
            proc.wait(30)
            assert time.monotonic() - started < 15, "the worker must leave when its trainer shuts down"
            assert proc.returncode == 0, proc.stderr.read()[-2000:]
        finally:
            _stop(proc)
            broadcaster.close()
        del it
