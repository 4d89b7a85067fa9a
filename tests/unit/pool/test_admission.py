"""asyncrl.pool.admission, without a socket: who a pool serves (HELLO, ids in use, max_peers, silence, statuses) and
how many leases each peer gets per grant pass (credits in halves or at once, the withheld seconds by the pool's
reason)."""

from __future__ import annotations

import pytest

from asyncrl.config import GateConfig
from asyncrl.pool.admission import EVICT_AFTER_HEARTBEATS, GREETED_PER_PEER, MAX_STATUS_KEYS, RATE_SPREAD, Admission
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
    for identity, worker_id in ((b"s", "static"), (b"f", "stream")):  # three groups of each come back
        for lease in [lease for lease in a.pool.ledger.leases.values() if lease.worker_id == worker_id][:3]:
            a.pool.release_held(lease.lease_id, worker_id, "rejected")
            a.returned(a.peers[identity], lease.lease_id, 0.05, accepted=False)
    # 3 free of 8: the static peer waits for half its credits, the streaming one takes them now
    assert {p.worker_id: len(ls) for p, ls in a.grants(now=0.1)} == {"stream": 3}
    assert a.grants(now=0.2, skip={b"f"}) == []


def test_credits_the_pool_withholds_are_charged_as_seconds_by_its_reason():
    a = _admission(prompts=4)
    a.hello(b"a", _hello("wa", slots=2), now=0.0)
    a.hello(b"b", _hello("wb", slots=4), now=0.0)
    a.hello(b"c", _hello("wc", slots=1), now=0.0)
    first = {p.worker_id: len(ls) for p, ls in a.grants(now=0.0)}
    assert first == {"wa": 1, "wb": 2, "wc": 1}  # in proportion to their slots, until the pool has no prompt left
    assert a.blocked == "no_prompt"
    a.grants(now=0.5)
    assert a.workers()["wb"]["credits_withheld_no_prompt_s"] == pytest.approx(0.5)
    assert a.workers(now=2.0)["wa"]["credits_withheld_no_prompt_s"] == pytest.approx(2.0)  # a wait going on counts
    assert all(v == 0 for k, v in a.workers(now=2.0)["wc"].items() if k.startswith("credits_withheld"))  # full
    a.drop(b"a", "worker_left")  # its lease goes back to the pool: wb takes it, and waits no more
    assert {p.worker_id: len(ls) for p, ls in a.grants(now=3.0)} == {"wb": 1}
    assert a.blocked == "no_prompt" and a.workers(now=5.0)["wb"]["credits_withheld_no_prompt_s"] == pytest.approx(5.0)


def test_a_worker_not_ready_is_greeted_but_granted_nothing_until_it_greets_again():
    a = _admission()
    waiting = a.hello(b"a", _hello("w", ready=False), now=0.0)
    assert waiting.joined and not waiting.peer.ready and a.grants(now=0.0) == []
    ready = a.hello(b"a", _hello("w", slots=2), now=1.0)  # the same connection, ready now: refreshed, not re-joined
    assert not ready.joined and ready.peer is waiting.peer and ready.peer.ready and ready.peer.slots == 2
    assert [len(ls) for _, ls in a.grants(now=1.0)] == [2]


# -- who gets each lease: weighted round-robin over the peers that want credits --------------------------------------
def _window(workers: int, window: int, slots: int = 8, **peer) -> Admission:
    """A pool whose staleness window (``window`` groups in flight) is smaller than workers x slots."""
    pool = RolloutPool(PromptLedger(10_000), group_size=2, capacity=10_000, max_staleness=0, groups_per_step=window,
                       max_prompt_failures=None)
    pool.start_epoch(0)
    a = Admission(pool, GateConfig(), heartbeat_s=HEARTBEAT_S, peer_timeout_s=PEER_TIMEOUT_S, now=0.0)
    for i in range(workers):
        a.hello(f"i{i}".encode(), _hello(f"w{i}", slots=slots, **peer), now=0.0)
    return a


def _cycle(a: Admission, now: float, turnaround: dict[str, float] | None = None) -> dict[str, int]:
    """The trainer takes every group in flight and starts a new step; every lease comes back first. Returns the
    leases each worker got in the pass that follows."""
    by_worker = {p.worker_id: p for p in a.peers.values()}
    for lease in list(a.pool.ledger.leases.values()):
        granted = by_worker[lease.worker_id].granted_at.get(lease.lease_id, now)
        back = granted + (turnaround or {}).get(lease.worker_id, 0.0)  # its group arrives this long after its grant
        a.returned(by_worker[lease.worker_id], lease.lease_id, back, accepted=True)
        a.pool.release_held(lease.lease_id, lease.worker_id, "rejected")  # as if its group came and was trained
    a.pool.set_policy_version(a.pool.policy_version + 1)
    return {p.worker_id: len(ls) for p, ls in a.grants(now=now)}


def test_a_window_smaller_than_workers_times_slots_reaches_every_worker_in_turn():
    """The old grant pass walked workers in join order and stopped at the first refusal: with a window of 4 groups
    and 10 workers of 8 slots, the first worker took all four leases, step after step, and 9 workers never worked."""
    a = _window(workers=10, window=4)
    got = {f"w{i}": 0 for i in range(10)}
    for step in range(10):
        for worker_id, n in (_cycle(a, now=float(step)) if step else
                             {p.worker_id: len(ls) for p, ls in a.grants(now=0.0)}).items():
            assert n == 1, "one lease each while others wait: leases spread, not batched on one worker"
            got[worker_id] += n
    assert set(got.values()) == {4}  # 40 leases over 10 workers: every worker, equally
    assert a.blocked == "window"


def test_leases_follow_each_workers_measured_rate_within_the_spread():
    """Two workers whose groups come back in 1 s and two in 2 s: the fast ones get twice the leases."""
    a = _window(workers=4, window=3)
    turnaround = {"w0": 1.0, "w1": 1.0, "w2": 2.0, "w3": 2.0}
    got = dict.fromkeys(turnaround, 0)
    a.grants(now=0.0)
    for step in range(1, 121):
        for worker_id, n in _cycle(a, now=10.0 * step, turnaround=turnaround).items():
            got[worker_id] += n
    fast, slow = got["w0"] + got["w1"], got["w2"] + got["w3"]
    assert fast + slow == 360 and fast / slow == pytest.approx(2.0, rel=0.1), got


def test_a_worker_measured_very_slow_still_gets_its_share():
    """A turnaround 100 times the others' (noise, a long prompt) counts as RATE_SPREAD times the average at most: the
    worker keeps getting leases, never starved."""
    a = _window(workers=3, window=2)
    turnaround = {"w0": 0.1, "w1": 0.1, "w2": 10.0}
    got = dict.fromkeys(turnaround, 0)
    a.grants(now=0.0)
    for step in range(1, 151):
        for worker_id, n in _cycle(a, now=100.0 * step, turnaround=turnaround).items():
            got[worker_id] += n
    assert got["w2"] >= 300 / (1 + 2 * RATE_SPREAD**2) * 0.8, got  # its weight is at least 1/RATE_SPREAD^2 of theirs


def test_a_worker_that_joins_gets_the_next_lease_and_one_that_comes_back_no_burst():
    a = _window(workers=4, window=4)
    for step in range(20):  # a long history: the four workers' passes have moved on
        _cycle(a, now=float(step)) if step else a.grants(now=0.0)
    a.hello(b"late", _hello("late", slots=8), now=20.0)
    first = _cycle(a, now=20.0)
    assert first.get("late") == 1, first  # the next lease, not after the others' history
    got = {"late": 0, "w0": 0}
    for step in range(21, 41):
        n = _cycle(a, now=float(step))
        got["late"] += n.get("late", 0)
        got["w0"] += n.get("w0", 0)
    assert abs(got["late"] - got["w0"]) <= 1, got  # then its turn like anyone's: no credit for the time away


def test_a_pass_looks_only_at_the_workers_something_happened_to():
    """Hundreds of workers waiting on a closed window: a pass with nothing new asks the pool once, whatever their
    number (it used to walk every worker and scan every lease, every 5 ms)."""
    a = _window(workers=300, window=4)
    a.grants(now=0.0)
    calls = {"grant": 0, "held": 0}
    grant, held = a.pool.grant, a.pool.held

    def counting_grant(*args, **kw):
        calls["grant"] += 1
        return grant(*args, **kw)

    def counting_held(*args, **kw):
        calls["held"] += 1
        return held(*args, **kw)

    a.pool.grant, a.pool.held = counting_grant, counting_held
    assert a.grants(now=1.0) == [] and calls == {"grant": 1, "held": 0}
    lease = next(iter(a.pool.ledger.leases.values()))
    peer = a.peers[f"i{lease.worker_id[1:]}".encode()]
    a.pool.release_held(lease.lease_id, lease.worker_id, "rejected")  # one lease back: its prompt to lease again
    a.returned(peer, lease.lease_id, now=2.0, accepted=False)
    ((got, leases),) = a.grants(now=2.0)
    assert len(leases) == 1 and got.worker_id != peer.worker_id  # the next in turn, not the one that returned it
    assert calls == {"grant": 3, "held": 1}


def test_the_peer_table_stays_consistent_when_workers_come_and_go():
    a = _window(workers=6, window=8, slots=2)
    a.grants(now=0.0)
    a.drop(b"i0", "worker_left")
    a.hello(b"i0", _hello("w0-new"), now=1.0)
    a.hello(b"i1", _hello("w1-other"), now=1.0)  # the same connection under another id: the old one is gone
    assert a.worker_of(b"i1") == "w1-other" and a.pool.outstanding()["w1"] == 0
    for _ in range(3):
        _cycle(a, now=2.0)
    served = {p.worker_id for p in a.peers.values() if a.pool.held(p.worker_id)}
    assert {"w0-new", "w1-other"} <= served
