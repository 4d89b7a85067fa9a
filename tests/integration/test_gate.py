"""The gate under attack: hostile peers speaking the protocol correctly. Each case is refused and counted
by reason, the healthy worker's epoch completes exactly once beside it, and nothing forged is consumed.

The rogue is a raw DEALER (:class:`Peer`); the good worker is a real local worker process."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch
import zmq

from asyncrl import FakeEngineConfig, GateConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.codec import decode, encode
from asyncrl.pool.admission import GREETED_PER_PEER
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.rollout import Group, Rollout
from asyncrl.transport import protocol as P
from asyncrl.transport.zmq import ZmqRolloutReceiver

pytestmark = pytest.mark.integration

GROUP_SIZE = 2


class Peer:
    """A hand-written worker end: one DEALER speaking the rollout protocol (a rogue)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # send() waits for the connection: every message reaches the pool
        self.sock.connect(endpoint)
        self.leases: list[dict] = []

    def send(self, kind: str, body: dict, timeout: float = 10.0) -> None:
        frames = encode(kind, body)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)

    def hello(self, worker_id: str, slots: int = 1) -> None:
        body = {"worker_id": worker_id, "slots": slots, "pid": 1, "host": "rogue", "protocol": P.PROTOCOL_VERSION}
        self.send(P.HELLO, body)

    def recv(self, kinds: set[str], timeout: float = 10.0) -> tuple[str, dict] | None:
        """The next message of one of ``kinds`` (leases seen on the way are kept), or None at the deadline."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(remaining * 1000) + 1):
                continue
            kind, body = decode(self.sock.recv_multipart(copy=False), max_message_bytes=1 << 26)
            if kind == P.LEASES:
                self.leases += body["leases"]
            if kind in kinds:
                return kind, body
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


def _group(prompt_index: int, *, worker_id: str = "rogue", reward: float = 0.5, prompt_id: int = 1,
           response_id: int = 3, logprob: float = -0.5) -> Group:
    rollouts = [
        Rollout(
            epoch=0,
            prompt_index=prompt_index,
            sample_index=s,
            worker_id=worker_id,
            policy_version=0,
            prompt_ids=torch.tensor([prompt_id, 2], dtype=torch.int32),
            response_ids=torch.tensor([response_id, 4, 5], dtype=torch.int32),
            logprobs=torch.tensor([logprob, -0.1, -0.2]),
            reward=reward,
        )
        for s in range(GROUP_SIZE)
    ]
    return Group(epoch=0, prompt_index=prompt_index, rollouts=rollouts)


def _config(*, gate: GateConfig | None = None, heartbeat_s: float = 0.2, **overrides) -> LoaderConfig:
    settings = dict(
        group_size=GROUP_SIZE,
        batch_size=4,
        capacity=16,
        num_workers=1,
        max_staleness=None,
        wait_timeout_s=60,
        lease_timeout_s=20,  # not reached when the gate works; bounds the test when it does not
        gate=gate or GateConfig(),
        transport=TransportConfig(heartbeat_s=heartbeat_s, peer_timeout_s=max(5.0, 4 * heartbeat_s)),
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=8, seconds_per_token=0.005)),
    )
    return LoaderConfig(**{**settings, **overrides})


def _prompts(n: int) -> list[dict]:
    return [{"prompt_ids": [i + 1]} for i in range(n)]


def _consume(it) -> list[tuple[str, list[str]]]:
    return [(g, batch["worker_ids"]) for batch in it for g in batch["group_ids"]]


def test_forged_groups_for_prompts_never_leased_are_not_consumed():
    num_prompts = 24
    ctx = zmq.Context()
    rogue = None
    try:
        with RolloutLoader(_prompts(num_prompts), _config()) as loader:
            rogue = Peer(ctx, loader.endpoint)
            rogue.hello("rogue", slots=1)
            assert rogue.recv({P.WELCOME}) is not None
            it = iter(loader)  # leases start
            assert rogue.recv({P.LEASES}) is not None
            mine = {lease["prompt_index"]: lease["lease_id"] for lease in rogue.leases}
            some_lease = next(iter(mine.values()))
            forged = [i for i in range(num_prompts) if i not in mine]
            for i in forged:  # a lease id it does hold, for another prompt: ownership is per prompt
                rogue.send(P.GROUP, {"lease_id": some_lease, "group": _group(i).to_wire()})
            rogue.send(P.BYE, {})  # its own lease goes back to the queue
            consumed = _consume(it)
            stats = loader.stats()
    finally:
        if rogue is not None:
            rogue.close()
        ctx.term()
    groups = collections.Counter(g for g, _ in consumed)
    assert set(groups) == {f"e0-p{i}" for i in range(num_prompts)} and max(groups.values()) == 1
    assert all(w != "rogue" for _, workers in consumed for w in workers), "a forged group was consumed"
    assert stats["transport"]["not_leased_to_peer"] == len(forged)
    assert any("not_leased_to_peer" in e[1] for e in stats["transport"]["recent_errors"])


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(reward=1e39), "gate_reward_not_finite_float32"),  # finite in float64, inf in the float32 batch
        (dict(reward=5e6), "gate_reward_out_of_range"),
        (dict(prompt_id=2147483647), "gate_token_id_out_of_range"),
        (dict(response_id=-5), "gate_token_id_out_of_range"),
        (dict(logprob=-1e30), "gate_logprob_out_of_range"),
    ],
    ids=["reward-1e39", "reward-5e6", "token-2147483647", "token-minus-5", "logprob-minus-1e30"],
)
def test_out_of_range_values_are_refused_and_regenerated(bad: dict, reason: str):
    _, stats, rejected, refused = rogue_answers_every_lease(16, lambda le: _group(le["prompt_index"], **bad), reason)
    assert stats["transport"]["groups_refused"] == refused
    assert any(reason in e[1] for e in stats["transport"]["recent_errors"])
    assert rejected and all(r["worker"] == "rogue" for r in rejected)


def rogue_answers_every_lease(num_prompts: int, make_group, reason: str):
    """Through the real pool: a rogue peer answers every lease it is granted with ``make_group(lease)`` (a group
    the gate must refuse for ``reason``), then leaves. Asserts what holds for every such fault: each refusal is
    counted under ``reason``, nothing of the rogue's is consumed, and every prompt of the epoch is consumed exactly
    once (regenerated by the healthy worker). Returns (consumed, stats, rejected rollouts, refusals)."""
    ctx = zmq.Context()
    rogue = None
    try:
        with RolloutLoader(_prompts(num_prompts), _config(gate=GateConfig(vocab_size=32000))) as loader:
            rogue = Peer(ctx, loader.endpoint)
            rogue.hello("rogue", slots=2)
            assert rogue.recv({P.WELCOME}) is not None
            it = iter(loader)
            assert rogue.recv({P.LEASES}) is not None
            for lease in rogue.leases:  # each a well-formed group for a lease it holds, with one bad value
                rogue.send(P.GROUP, {"lease_id": lease["lease_id"], "group": make_group(lease).to_wire()})
            deadline = time.monotonic() + 10
            while loader.stats()["transport"].get(reason, 0) < len(rogue.leases) and time.monotonic() < deadline:
                time.sleep(0.02)
            rogue.send(P.BYE, {})
            consumed = _consume(it)
            stats = loader.stats()
            rejected = loader.rejected_rollouts()
    finally:
        if rogue is not None:
            rogue.close()
        ctx.term()
    groups = collections.Counter(g for g, _ in consumed)
    assert set(groups) == {f"e0-p{i}" for i in range(num_prompts)} and max(groups.values()) == 1
    assert all(w != "rogue" for _, workers in consumed for w in workers), "a refused group was consumed"
    assert stats["transport"][reason] == len(rogue.leases) > 0
    return consumed, stats, rejected, len(rogue.leases)


def test_hello_storm_reusing_a_live_workers_id_does_not_evict_it():
    num_prompts = 40
    ctx = zmq.Context()
    stop = threading.Event()
    hellos = 0

    def storm(endpoint: str) -> None:
        nonlocal hellos
        rogue = Peer(ctx, endpoint)
        try:
            while not stop.is_set():
                rogue.hello("r0w-0", slots=8)  # the local worker's id
                hellos += 1
                stop.wait(0.05)
        finally:
            rogue.close()

    # heartbeat 0.5 s: the live worker is evicted only after 1.25 s of silence, well above scheduling jitter
    with RolloutLoader(_prompts(num_prompts), _config(heartbeat_s=0.5)) as loader:
        it = iter(loader)
        first = _consume_one(it)
        thread = threading.Thread(target=storm, args=(loader.endpoint,), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while loader.stats()["transport"].get("hello_refused_id_in_use", 0) < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            consumed = first + _consume(it)
            stats = loader.stats()
        finally:
            stop.set()
            thread.join(5)
    ctx.term()
    groups = collections.Counter(g for g, _ in consumed)
    assert set(groups) == {f"e0-p{i}" for i in range(num_prompts)} and max(groups.values()) == 1
    transport = stats["transport"]
    assert transport.get("worker_restarted", 0) == 0
    assert transport.get("workers_lost", 0) == 0
    assert transport["hello_refused_id_in_use"] >= 5
    assert list(transport["workers"]) == ["r0w-0"] and transport["workers"]["r0w-0"]["groups"] > 0
    assert stats["ledger"].get("regenerated", 0) == 0


def _consume_one(it) -> list[tuple[str, list[str]]]:
    batch = next(it)
    return [(g, batch["worker_ids"]) for g in batch["group_ids"]]


def test_ghost_identities_are_bounded_and_do_not_inflate_regeneration():
    num_prompts, max_peers, ghosts = 40, 8, 1000  # 1000 identities against a bound of GREETED_PER_PEER x 8 = 32
    ctx = zmq.Context()
    ctx.max_sockets = ghosts + 100  # closed ghosts linger until their HELLO has left
    lingering: list[Peer] = []
    done = threading.Event()

    def haunt(endpoint: str) -> None:
        for i in range(ghosts):
            ghost = Peer(ctx, endpoint)
            ghost.hello(f"ghost-{i}", slots=1)
            if i < 2 * max_peers:
                lingering.append(ghost)  # connected and silent: they fill max_peers
            else:
                ghost.sock.close(linger=1000)  # says HELLO and vanishes
        done.set()

    config = _config(gate=GateConfig(max_peers=max_peers), lease_timeout_s=5)
    with RolloutLoader(_prompts(num_prompts), config) as loader:
        it = iter(loader)
        first = _consume_one(it)
        thread = threading.Thread(target=haunt, args=(loader.endpoint,), daemon=True)
        thread.start()
        assert done.wait(120)
        peak = len(loader.stats()["transport"]["workers"])
        consumed = first + _consume(it)
        stats = loader.stats()
        greeted = len(loader.receiver.admission.greeted)
    for ghost in lingering:
        ghost.close()
    ctx.term()
    groups = collections.Counter(g for g, _ in consumed)
    assert set(groups) == {f"e0-p{i}" for i in range(num_prompts)} and max(groups.values()) == 1
    transport = stats["transport"]
    assert peak <= max_peers and len(transport["workers"]) <= max_peers
    assert transport["hello_refused_max_peers"] > 0
    assert greeted <= GREETED_PER_PEER * max_peers
    # a lease that reached a ghost before it vanished is generated again, once: never a lease per grant attempt
    assert stats["ledger"].get("regenerated", 0) <= transport["workers_joined"], (stats["ledger"], transport)


def _bare_pool(num_prompts: int, config: TransportConfig, gate: GateConfig) -> tuple[RolloutPool, ZmqRolloutReceiver]:
    pool = RolloutPool(PromptLedger(num_prompts), group_size=GROUP_SIZE, capacity=num_prompts)
    receiver = ZmqRolloutReceiver(config, pool, lambda i: {"prompt_ids": [i + 1]}, gate=gate)
    pool.start_epoch(0)
    receiver.start()
    return pool, receiver


def test_slots_claimed_in_hello_are_capped_per_peer():
    pool, receiver = _bare_pool(200, TransportConfig(heartbeat_s=0.2), GateConfig(max_slots_per_peer=4))
    ctx = zmq.Context()
    rogue = Peer(ctx, receiver.endpoint)
    try:
        rogue.hello("hoarder", slots=65536)
        assert rogue.recv({P.WELCOME}) is not None
        rogue.recv({"never"}, timeout=1.0)  # collect every lease granted meanwhile
        stats = receiver.stats()
    finally:
        rogue.close()
        receiver.close()
        ctx.term()
    assert len(rogue.leases) == 4
    assert stats["workers"]["hoarder"]["slots"] == 4 and stats["slots_capped"] == 1


def test_oversized_frame_is_counted():
    limit = 1 << 16
    pool, receiver = _bare_pool(4, TransportConfig(heartbeat_s=0.2, max_message_bytes=limit), GateConfig())
    ctx = zmq.Context()
    rogue = Peer(ctx, receiver.endpoint)
    try:
        rogue.hello("big", slots=1)
        assert rogue.recv({P.WELCOME}) is not None
        rogue.sock.send(b"x" * (2 * limit))  # libzmq drops the connection (MAXMSGSIZE) without a message
        deadline = time.monotonic() + 10
        while receiver.stats().get("connections_dropped", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = receiver.stats()
    finally:
        rogue.close()
        receiver.close()
        ctx.term()
    assert stats["connections_dropped"] >= 1


def test_answers_to_leases_a_live_load_cancelled_are_counted_apart_from_forgeries():
    """A live load_state_dict cancels the leases workers hold; their answers arrive late. They are this run's own
    workers, not forgers: counted as cancelled_lease_answers, and not_leased_to_peer stays the forged-group signal."""
    ctx = zmq.Context()
    peer = None
    try:
        with RolloutLoader(_prompts(8), _config(num_workers=0)) as loader:
            it = iter(loader)  # the pool grants from now on
            peer = Peer(ctx, loader.endpoint)
            peer.hello("own-worker", slots=2)
            assert peer.recv({P.LEASES}) is not None and peer.leases, "the worker got no lease"
            held = list(peer.leases)
            loader.load_state_dict(loader.state_dict())  # e.g. a rollback to the state it just saved
            for lease in held:
                peer.send(P.GROUP, {"lease_id": lease["lease_id"],
                                    "group": _group(lease["prompt_index"], worker_id="own-worker").to_wire()})
            deadline = time.monotonic() + 10
            while (loader.stats()["transport"].get("cancelled_lease_answers", 0) < len(held)
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            stats = loader.stats()["transport"]
            del it
    finally:
        if peer is not None:
            peer.close()
        ctx.term()
    assert stats.get("cancelled_lease_answers", 0) == len(held)
    assert stats.get("not_leased_to_peer", 0) == 0


def test_a_peer_that_never_said_hello_gets_no_answer():
    """Each heartbeat from a peer without HELLO used to be answered (RESYNC): an amplifier. Now it is counted and
    left unanswered; a worker that did say HELLO on a connection the pool forgot greets again by itself."""
    ctx = zmq.Context()
    rogue = None
    try:
        with RolloutLoader(_prompts(8), _config(num_workers=0)) as loader:
            rogue = Peer(ctx, loader.endpoint)
            for _ in range(200):
                rogue.send(P.HEARTBEAT, {"status": {"policy_version": 0}})
            rogue.send(P.FAILED, {"lease_id": 1, "error": "x"})
            rogue.send(P.BYE, {})
            assert rogue.recv(set(P.POOL_KINDS), timeout=1.0) is None, "the pool answered a peer it never greeted"
            deadline = time.monotonic() + 10
            while loader.stats()["transport"].get("messages_without_hello", 0) < 202 and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = loader.stats()["transport"]
    finally:
        if rogue is not None:
            rogue.close()
        ctx.term()
    assert stats["messages_without_hello"] == 202
    assert stats.get("leases_failed", 0) == 0
