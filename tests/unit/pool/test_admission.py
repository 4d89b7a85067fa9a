"""asyncrl.pool.admission, without a socket: who a pool serves (HELLO, ids in use, max_peers, silence, statuses) and
how many leases each peer gets per grant pass (credits in halves or at once, the withheld seconds by the pool's
reason)."""

from __future__ import annotations

import pytest

from asyncrl.config import GateConfig
from asyncrl.pool.admission import EVICT_AFTER_HEARTBEATS, GREETED_PER_PEER, MAX_STATUS_KEYS, Admission
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger

HEARTBEAT_S, PEER_TIMEOUT_S = 1.0, 10.0


def _admission(prompts: int = 40, capacity: int = 64, **gate) -> Admission:
    pool = RolloutPool(PromptLedger(prompts), group_size=2, capacity=capacity)
    pool.start_epoch(0)
    return Admission(pool, GateConfig(**gate), heartbeat_s=HEARTBEAT_S, peer_timeout_s=PEER_TIMEOUT_S, now=0.0)


def _hello(worker_id: str, slots: int = 4, **extra) -> dict:
    return {"worker_id": worker_id, "slots": slots, "pid": 1, "host": "h", **extra}


def test_a_hello_admits_a_peer_with_its_credits_capped():
    a = _admission(max_slots_per_peer=8)
    first = a.hello(b"i1", _hello("w1", slots=100), now=0.0)
    assert first.refusal is None and first.joined and first.capped and first.peer.slots == 8
    again = a.hello(b"i1", _hello("w1", slots=4), now=1.0)
    assert again.refusal is None and not again.joined and a.peers[b"i1"].slots == 4
    assert a.worker_of(b"i1") == "w1" and a.worker_of(b"nobody") is None


def test_a_live_worker_keeps_its_id_and_a_silent_one_is_replaced_with_its_leases_requeued():
    a = _admission()
    a.hello(b"old", _hello("w"), now=0.0)
    ((peer, leases),) = a.grants(now=0.0)
    assert peer.worker_id == "w" and len(leases) == 4
    refused = a.hello(b"new", _hello("w"), now=EVICT_AFTER_HEARTBEATS * HEARTBEAT_S)  # still within its heartbeats
    assert refused.refusal.reason == "hello_refused_id_in_use" and list(a.peers) == [b"old"]
    later = a.hello(b"new", _hello("w"), now=EVICT_AFTER_HEARTBEATS * HEARTBEAT_S + 0.1)
    ((evicted, released),) = later.evicted
    assert evicted.identity == b"old" and len(released) == 4 and list(a.peers) == [b"new"]
    assert a.pool.outstanding()["w"] == 0  # the old leases went back to the pool


def test_at_most_max_peers_are_served_and_greeted_identities_are_bounded():
    a = _admission(max_peers=2)
    assert all(a.hello(bytes([i]), _hello(f"w{i}"), now=0.0).refusal is None for i in range(2))
    assert a.hello(b"third", _hello("w3"), now=0.0).refusal.reason == "hello_refused_max_peers"
    for i in range(100):  # peers come and go: what is remembered for SHUTDOWN stays bounded
        a.drop(bytes([i % 2]), "worker_left")
        a.hello(bytes([i % 2]), _hello(f"x{i}"), now=float(i))
        a.hello(bytes([200 + i % 50]), _hello(f"y{i}"), now=float(i))
    assert len(a.greeted) <= GREETED_PER_PEER * 2


def test_silent_peers_are_found_and_forgotten_ones_owe_no_shutdown():
    a = _admission()
    a.hello(b"a", _hello("wa"), now=0.0)
    a.hello(b"b", _hello("wb"), now=5.0)
    assert a.silent(now=PEER_TIMEOUT_S + 1) == [b"a"]
    a.forget(b"b")
    assert b"b" not in a.greeted and b"b" in a.peers


def test_a_status_too_big_or_of_the_wrong_kind_is_refused_and_the_previous_one_stays():
    a = _admission()
    peer = a.hello(b"a", _hello("w"), now=0.0).peer
    assert a.status(peer, {"policy_version": 3, "note": "x" * 500}) is None
    assert peer.status == {"policy_version": 3, "note": "x" * 200}
    big = a.status(peer, {f"k{i}": i for i in range(MAX_STATUS_KEYS + 1)})
    assert big.reason == "statuses_refused" and f"{MAX_STATUS_KEYS + 1} keys" in big.error
    assert a.status(peer, {"nested": {"no": 1}}).reason == "statuses_refused"
    assert peer.status["policy_version"] == 3
    assert a.workers()["w"]["policy_version"] == 3


def test_credits_are_topped_up_in_halves_and_a_streaming_peer_gets_every_free_one():
    a = _admission()
    a.hello(b"s", _hello("static", slots=8), now=0.0)
    a.hello(b"f", _hello("stream", slots=8, streaming=True), now=0.0)
    assert {p.worker_id: len(ls) for p, ls in a.grants(now=0.0)} == {"static": 8, "stream": 8}
    for worker_id in ("static", "stream"):  # three groups of each come back
        for lease in [lease for lease in a.pool.ledger.leases.values() if lease.worker_id == worker_id][:3]:
            a.pool.release_held(lease.lease_id, worker_id, "rejected")
    # 3 free of 8: the static peer waits for half its credits, the streaming one takes them now
    assert {p.worker_id: len(ls) for p, ls in a.grants(now=0.1)} == {"stream": 3}
    assert a.grants(now=0.2, skip={b"f"}) == []


def test_credits_the_pool_withholds_are_charged_as_seconds_by_its_reason():
    a = _admission(prompts=4)
    a.hello(b"a", _hello("wa", slots=4), now=0.0)
    a.hello(b"b", _hello("wb", slots=8), now=0.0)
    first = a.grants(now=0.0)
    assert [len(ls) for _, ls in first] == [4]  # all four prompts to the first peer; the pool had none for the second
    a.grants(now=0.5)
    workers = a.workers()
    assert workers["wb"]["credits_withheld_no_prompt_s"] == pytest.approx(0.5)
    assert all(v == 0 for k, v in workers["wa"].items() if k.startswith("credits_withheld"))


def test_a_worker_not_ready_is_greeted_but_granted_nothing_until_it_greets_again():
    a = _admission()
    waiting = a.hello(b"a", _hello("w", ready=False), now=0.0)
    assert waiting.joined and not waiting.peer.ready and a.grants(now=0.0) == []
    ready = a.hello(b"a", _hello("w", slots=2), now=1.0)  # the same connection, ready now: refreshed, not re-joined
    assert not ready.joined and ready.peer is waiting.peer and ready.peer.ready and ready.peer.slots == 2
    assert [len(ls) for _, ls in a.grants(now=1.0)] == [2]
