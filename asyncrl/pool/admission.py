"""Admission and credits: which workers a pool serves, and which of them gets each lease.

The pool side of credit-based flow control, as a pure unit: a table of peers and the decisions over it, with no
socket, no thread and no clock of its own. The rollout channel's I/O thread (``asyncrl/transport/zmq.py``) tells it
what arrived (a HELLO, a status, a BYE, a group or a failure for a lease, leases expired) and what time it is, runs a
grant pass when something may have changed, sends what it decides (WELCOME or a refusal, LEASES) and counts every
decision under the reason given here.

- **Admission**: a HELLO registers a peer with its credits (``slots``, capped at ``gate.max_slots_per_peer``; none
  granted while it says it is not ``ready``: it still waits for the trainer's weights); at most
  ``gate.max_peers`` are served; a HELLO reusing a live worker's id is refused (``hello_refused_id_in_use``) and
  evicts it only once it has been silent for :data:`EVICT_AFTER_HEARTBEATS` heartbeats (a restarted process); a peer
  silent for ``transport.peer_timeout_s`` is dropped and its leases go back to the pool.
- **Who wants credits**: a peer joins the queue when it has free credits (a streaming one: any; a static one: none
  held, or half its credits free, so that its leases come in batches) and leaves it when it holds all its credits.
- **Who gets a lease**: weighted round-robin over the queue (stride scheduling). Each lease granted to a peer moves
  its *pass* on by its stride, ``turnaround / slots`` (the seconds from a grant to that lease's accepted group, an
  average measured here, over the credits it runs at once): a peer that returns groups twice as fast, or has twice
  the slots, gets twice the leases when there are fewer leases than credits (a staleness window smaller than
  workers × slots), and peers alike take turns, so every one of them gets work. The lowest pass goes first, ties to
  the peer granted longest ago; a peer that (re)joins the queue starts at the pass of the last lease granted, so a
  worker that joins gets the next lease and one that was away gets no burst for it. A peer with no turnaround yet
  gets the average of all peers'; turnarounds count from :data:`TURNAROUND_FLOOR_S` and within :data:`RATE_SPREAD`
  times the average, so a noisy measurement never starves a worker. Rates come from what the pool sees, never from
  what a worker says of itself.
- **Withheld time**: while the pool grants nothing (its reason, :data:`WITHHELD`), every peer in the queue is charged
  that time, by reason, as seconds; the accounting is exact between passes (integrals of the pool's blocked time,
  taken when a peer joins and leaves the queue), so grants can be rare without losing time.

Cost: a pass looks only at the peers something happened to since the last one (marked with :meth:`touch`) and then
at most one queue entry per lease granted, plus one more when the pool refuses: ``O((touched + granted) log peers)``;
:meth:`touch_all` (a reset, and the channel's periodic resynchronisation) looks at every peer once.

Thread safety: the I/O thread makes every decision; :meth:`Admission.workers` may be read from another thread (the
trainer's ``stats()``), and the peer table is changed and read under :attr:`Admission.lock`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import GateConfig
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import Lease

__all__ = ["EVICT_AFTER_HEARTBEATS", "GREETED_PER_PEER", "MAX_STATUS_KEYS", "RATE_SPREAD", "TURNAROUND_FLOOR_S",
           "TURNAROUND_WEIGHT", "WITHHELD", "Admission", "Greeting", "Peer", "Refusal"]

EVICT_AFTER_HEARTBEATS = 2.5
"""A HELLO reusing a connected worker's id evicts that worker only once it has been silent this many
``heartbeat_s`` (a restarted process takes seconds to start); otherwise the newcomer is refused."""
GREETED_PER_PEER = 4
"""Identities remembered for SHUTDOWN and late groups: at most this many times ``gate.max_peers``."""
MAX_STATUS_KEYS = 64
"""Most keys of a worker status (heartbeat) a pool keeps; a bigger status is ignored (the previous one stays),
counted as ``statuses_refused`` and named in ``recent_errors``. The largest status a worker sends today has 30 keys (a
streaming worker with weight verification and shadow or delta counters); a worker that builds a bigger one logs an
error itself (``RolloutWorker.report``)."""
WITHHELD = ("window", "capacity", "bytes", "no_prompt")
"""Why the pool granted no credit to a worker that had free ones (:attr:`asyncrl.pool.buffer.RolloutPool.withheld`); the
seconds of each are in the worker's entry of the receiver's ``stats()`` as ``credits_withheld_{why}_s``: ``window`` is
the staleness window (groups leased and buffered that the trainer has not taken: a trainer slower than the workers),
``capacity`` the pool's ``capacity``, ``bytes`` its ``max_buffer_bytes``, ``no_prompt`` nothing left to lease. A worker
short of leases with none of these growing is waiting on the credit round trip."""
_STATUS_TYPES = frozenset({int, float, str, bool})
"""Types of a status value (bool is an int; a subclass of str or int from a decoder is not expected)."""
TURNAROUND_WEIGHT = 0.1
"""Weight of the newest sample in a peer's moving average of lease turnaround (grant to accepted group)."""
TURNAROUND_FLOOR_S = 0.05
"""Turnarounds shorter than this count as this: below it they measure the pool's own queueing, not the worker."""
RATE_SPREAD = 2.0
"""A peer's share of the leases counts its rate up to this many times the average's, or down to a fraction of it: a
noisy or stale measurement never starves a worker (nor lets one hoard)."""
GRANT_TIMES_PER_SLOT = 2
"""Grant times kept per credit of a peer, to measure turnarounds (leases that never come back are forgotten)."""


@dataclass(slots=True)
class Peer:
    """One worker connection the pool serves."""

    identity: bytes
    worker_id: str
    slots: int
    pid: int
    host: str
    joined: float
    last_seen: float
    groups: int = 0
    status: dict[str, Any] | None = None
    streaming: bool = False
    """The worker streams (continuous batching): it wants a credit back as soon as one is free (a static worker
    waits until half are)."""
    withheld_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WITHHELD, 0.0))
    """Seconds this worker wanted credits (it was in the queue) while the pool granted none, by the pool's reason;
    the time of a wait still going on is added by :meth:`Admission.workers`."""
    ready: bool = True
    """False while the worker waits for the trainer's weights (HELLO ``ready: false``): greeted, granted nothing."""
    held: int = 0
    """Leases it holds, as last read from the pool (refreshed when it is touched) plus those granted since."""
    turnaround_s: float | None = None
    """Moving average of the seconds from granting it a lease to its accepted group (None: none yet)."""
    granted_at: dict[int, float] = field(default_factory=dict)
    """Lease id -> when it was granted, for the turnaround; bounded (:data:`GRANT_TIMES_PER_SLOT`)."""
    vpass: float = 0.0
    """Its pass in the weighted round-robin: the lowest in the queue gets the next lease."""
    last_granted: float = -math.inf
    queued: int | None = None
    """The sequence number of its live queue entry (None: not in the queue)."""
    waited: tuple[float, ...] | None = None
    """The pool's blocked-time integrals (:data:`WITHHELD` order) when it joined the queue."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A decision against a peer: the counter it is counted under and the error it is named with."""

    reason: str
    error: str


@dataclass(slots=True)
class Greeting:
    """What :meth:`Admission.hello` decided: the peer admitted, or why not, and who it replaced."""

    peer: Peer | None = None
    refusal: Refusal | None = None
    evicted: list[tuple[Peer, list[Lease]]] = field(default_factory=list)
    """Silent peers with the newcomer's worker id, dropped for it, with their leases (already back in the pool)."""
    joined: bool = False
    """A new peer (not one greeting again on its connection: ready now, or after hearing nothing)."""
    capped: bool = False
    """Its slots were capped at ``gate.max_slots_per_peer``."""


class Admission:
    """The peer table of one pool and the admission and credit decisions over it (see the module docstring).

    Args:
        pool: the pool whose leases the peers hold.
        gate: the per-peer caps (``max_peers``, ``max_slots_per_peer``).
        heartbeat_s: the channel's heartbeat interval (eviction of a silent id holder).
        peer_timeout_s: silence after which a peer is dead.
        now: the clock's reading at start.
    """

    def __init__(self, pool: RolloutPool, gate: GateConfig, *, heartbeat_s: float, peer_timeout_s: float, now: float):
        self.pool = pool
        self.gate = gate
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.lock = threading.Lock()
        """Guards :attr:`peers` against a reader on another thread (the I/O thread is the only writer)."""
        self.peers: dict[bytes, Peer] = {}
        self._by_worker: dict[str, bytes] = {}
        self.greeted: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        """Identity -> worker id of every identity welcomed, oldest first, bounded (SHUTDOWN is owed to each)."""
        self._queue: list[tuple[float, float, int, bytes]] = []  # (pass, last granted, seq, identity); stale entries
        self._seq = itertools.count()
        self._touched: set[bytes] = set()
        self._vtime = 0.0  # the pass of the last lease granted
        self._turnaround_all: float | None = None  # moving average over every peer's accepted groups
        self.blocked: str | None = None
        """The pool's reason at the end of the last pass, if peers still wanted credits then (None: nobody waits)."""
        self._blocked_s = [0.0] * len(WITHHELD)  # seconds the pool has been blocked, by reason, up to _now
        self._now = now

    # -- admission -------------------------------------------------------------------------------------------
    def hello(self, identity: bytes, body: dict[str, Any], now: float) -> Greeting:
        """A HELLO (``worker_id``, ``slots``, ``pid``, ``host``; optional ``streaming``, ``ready``) from ``identity``.

        A HELLO from a peer already registered on that connection under that id refreshes it (its credits, whether it
        is ready); ``ready: false`` greets a worker that waits for the trainer's weights: it is granted nothing until
        it greets again without it."""
        self._advance(now)
        worker_id = body["worker_id"]
        greeting = Greeting()
        other = self._by_worker.get(worker_id)
        if other is not None and other != identity:
            p = self.peers[other]
            if now - p.last_seen <= EVICT_AFTER_HEARTBEATS * self.heartbeat_s:
                # a live worker keeps its id: a newcomer reusing it is refused (it may retry HELLO)
                greeting.refusal = Refusal("hello_refused_id_in_use", f"worker id {worker_id!r} is in use by a live peer")
                return greeting
            # a restarted process with the same id: the old one is silent
            greeting.evicted.append(self.drop(other, "worker_restarted"))
            self.greeted.pop(other, None)
        if identity not in self.peers and len(self.peers) >= self.gate.max_peers:
            greeting.refusal = Refusal("hello_refused_max_peers",
                                       f"already serving gate.max_peers={self.gate.max_peers}")
            return greeting
        slots = body["slots"]
        if slots > self.gate.max_slots_per_peer:
            greeting.capped, slots = True, self.gate.max_slots_per_peer
        self.greeted.pop(identity, None)
        self.greeted[identity] = worker_id
        while len(self.greeted) > GREETED_PER_PEER * self.gate.max_peers:
            self.greeted.popitem(last=False)
        ready = body.get("ready") is not False
        known = self.peers.get(identity)
        if known is not None and known.worker_id == worker_id:  # greeted again (ready now, or it heard nothing)
            known.slots, known.ready, known.last_seen = slots, ready, now
            greeting.peer = known
            self._touched.add(identity)
            return greeting
        if known is not None:  # the same connection under another worker id: the old one is gone
            greeting.evicted.append(self.drop(identity, "worker_restarted"))
        greeting.joined = True
        greeting.peer = Peer(identity, worker_id, slots, body["pid"], body["host"][:128], now, now,
                             streaming=body.get("streaming") is True, ready=ready)
        with self.lock:
            self.peers[identity] = greeting.peer
            self._by_worker[worker_id] = identity
        self._touched.add(identity)
        return greeting

    def worker_of(self, identity: bytes) -> str | None:
        """The worker id ``identity`` is served under, or greeted with (a peer reaped after a late heartbeat)."""
        peer = self.peers.get(identity)
        return peer.worker_id if peer is not None else self.greeted.get(identity)

    def status(self, peer: Peer, status: dict[str, Any]) -> Refusal | None:
        """Keeps a heartbeat's status (values cut to 200 characters), or says why it was refused (the previous one
        stays)."""
        # a heartbeat a second from each of hundreds of workers: the checks run on types, in C, not per value in Python
        types = set(map(type, status.values()))
        if len(status) <= MAX_STATUS_KEYS and types <= _STATUS_TYPES and set(map(type, status)) <= {str}:
            if str in types:
                status = {k: v[:200] if type(v) is str else v for k, v in status.items()}
            peer.status = status
            return None
        return Refusal("statuses_refused", f"a status of {len(status)} keys (at most {MAX_STATUS_KEYS}, values "
                                           "int/float/str) was ignored; the previous one stays")

    def drop(self, identity: bytes, reason: str) -> tuple[Peer, list[Lease]]:
        """Forgets a peer and gives its leases back to the pool: ``(peer, leases re-queued)``."""
        peer = self.peers[identity]
        self._leave_queue(peer)
        with self.lock:
            del self.peers[identity]
            if self._by_worker.get(peer.worker_id) == identity:
                del self._by_worker[peer.worker_id]
        self._touched.discard(identity)
        return peer, self.pool.release_worker(peer.worker_id, reason)

    def forget(self, identity: bytes) -> None:
        """``identity`` left (BYE) or cannot be reached: no SHUTDOWN is owed to it."""
        self.greeted.pop(identity, None)

    def silent(self, now: float) -> list[bytes]:
        """The peers not heard from for ``peer_timeout_s`` (dead: the caller drops them)."""
        return [identity for identity, p in self.peers.items() if now - p.last_seen > self.peer_timeout_s]

    def workers(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Each peer as the receiver's ``stats()["workers"]`` shows it (any thread); a wait still going on is
        counted up to ``now`` (default: the last time the I/O thread told)."""
        totals = self._blocked_totals(self._now if now is None else max(now, self._now))
        with self.lock:
            peers = list(self.peers.values())
        out = {}
        for p in peers:
            withheld, waited = p.withheld_s, p.waited
            if waited is not None:
                withheld = {why: s + totals[i] - waited[i] for i, (why, s) in enumerate(withheld.items())}
            out[p.worker_id] = {"pid": p.pid, "host": p.host, "slots": p.slots, "groups": p.groups, "ready": p.ready,
                                **(p.status or {}),
                                **{f"credits_withheld_{why}_s": round(v, 4) for why, v in withheld.items()}}
        return out

    def ready_workers(self) -> int:
        """Peers that serve: greeted and not waiting for the trainer's weights (any thread)."""
        with self.lock:
            return sum(p.ready for p in self.peers.values())

    # -- what happened to a peer's leases --------------------------------------------------------------------
    def touch(self, identity: bytes) -> None:
        """Something happened to this peer's leases (a group, a failure, a refusal): looked at by the next pass."""
        if identity in self.peers:
            self._touched.add(identity)

    def touch_worker(self, worker_id: str) -> None:
        """As :meth:`touch`, by worker id (leases expired)."""
        identity = self._by_worker.get(worker_id)
        if identity is not None:
            self._touched.add(identity)

    def touch_all(self) -> None:
        """Every peer is looked at by the next pass (leases cancelled by a reset; the periodic resynchronisation with
        the pool, which also drops leases the pool cancelled on its own: a duplicate's, a skipped prompt's)."""
        self._touched.update(self.peers)

    def returned(self, peer: Peer, lease_id: int, now: float, *, accepted: bool) -> None:
        """The group (``accepted``) or the failure for ``lease_id`` came back from ``peer``: its credit is free, and
        an accepted group's turnaround is a sample of the peer's rate."""
        granted = peer.granted_at.pop(lease_id, None)
        if accepted and granted is not None:
            sample = max(now - granted, 0.0)
            peer.turnaround_s = sample if peer.turnaround_s is None else (
                peer.turnaround_s + TURNAROUND_WEIGHT * (sample - peer.turnaround_s))
            self._turnaround_all = sample if self._turnaround_all is None else (
                self._turnaround_all + TURNAROUND_WEIGHT * (sample - self._turnaround_all))
        self._touched.add(peer.identity)

    def undelivered(self, peer: Peer, leases: list[Lease]) -> None:
        """Leases granted to ``peer`` never reached it (the pool took them back): its credits are free again."""
        for lease in leases:
            peer.granted_at.pop(lease.lease_id, None)
        peer.held = max(peer.held - len(leases), 0)
        self._touched.add(peer.identity)

    # -- credits ---------------------------------------------------------------------------------------------
    def grants(self, now: float, skip: set[bytes] | frozenset[bytes] = frozenset()) -> list[tuple[Peer, list[Lease]]]:
        """One grant pass: the leases each peer gets now (peers in ``skip``, unreachable, get none in this pass).

        The peers touched since the last pass are looked at again (their leases as the pool counts them, whether they
        want credits); then the queue is served one lease at a time, lowest pass first, until it is empty or the pool
        refuses (its reason is then :attr:`blocked`, and every peer still in the queue is charged the time until the
        pool grants again).
        """
        self._advance(now)
        if self._touched:
            # one look at the pool for many peers (a reset, the periodic re-read), one per peer for a few
            counts = self.pool.outstanding() if len(self._touched) > 8 else None
            for identity in self._touched:
                peer = self.peers.get(identity)
                if peer is not None:
                    peer.held = counts[peer.worker_id] if counts is not None else self.pool.held(peer.worker_id)
                    self._refresh(peer)
            self._touched.clear()
        out: dict[bytes, tuple[Peer, list[Lease]]] = {}
        skipped: list[Peer] = []
        blocked = None
        while self._queue:
            vpass, _, seq, identity = self._queue[0]
            peer = self.peers.get(identity)
            if peer is None or peer.queued != seq:
                heapq.heappop(self._queue)  # stale entry: the peer left the queue or was queued again
                continue
            if identity in skip:
                heapq.heappop(self._queue)
                self._leave_queue(peer)
                skipped.append(peer)
                continue
            leases = self.pool.grant(peer.worker_id, 1, now)
            if not leases:
                blocked = self.pool.withheld or "no_prompt"
                break
            heapq.heappop(self._queue)
            self._vtime = max(self._vtime, vpass)
            peer.vpass = vpass + self._stride(peer)
            peer.held += 1
            peer.last_granted = now
            peer.granted_at[leases[0].lease_id] = now
            if len(peer.granted_at) > GRANT_TIMES_PER_SLOT * peer.slots:
                del peer.granted_at[next(iter(peer.granted_at))]  # the oldest: expired or cancelled, most likely
            out.setdefault(identity, (peer, []))[1].extend(leases)
            if peer.held < peer.slots:
                self._push(peer)
            else:
                self._leave_queue(peer)
        for peer in skipped:  # unreachable now: looked at again by the next pass (if it is not dropped meanwhile)
            self._touched.add(peer.identity)
        self.blocked = blocked
        return list(out.values())

    def _refresh(self, peer: Peer) -> None:
        """Joins or leaves the queue as the peer's credits say (see the module docstring)."""
        free = peer.slots - peer.held
        if peer.queued is not None:
            if not peer.ready or free <= 0:
                self._leave_queue(peer)
            return
        if peer.ready and free > 0 and (peer.streaming or peer.held == 0 or free >= max(1, peer.slots // 2)):
            peer.vpass = max(peer.vpass, self._vtime)  # no credit for the time away, no burst for it
            peer.waited = self._blocked_totals(self._now)
            self._push(peer)

    def _push(self, peer: Peer) -> None:
        peer.queued = next(self._seq)
        heapq.heappush(self._queue, (peer.vpass, peer.last_granted, peer.queued, peer.identity))

    def _leave_queue(self, peer: Peer) -> None:
        """Out of the queue (its entry goes stale); the wait it had is charged to its withheld seconds."""
        peer.queued = None
        if peer.waited is not None:
            totals = self._blocked_totals(self._now)
            for i, why in enumerate(WITHHELD):
                peer.withheld_s[why] += totals[i] - peer.waited[i]
            peer.waited = None

    def _stride(self, peer: Peer) -> float:
        """How far one lease moves a peer's pass: its turnaround relative to the average (the inverse of its relative
        rate), within :data:`RATE_SPREAD`, over its slots; turnarounds count from :data:`TURNAROUND_FLOOR_S`. Relative,
        so that passes keep one scale as the average moves (and before anything is measured)."""
        average = self._turnaround_all
        if average is None or peer.turnaround_s is None:
            return 1.0 / peer.slots
        relative = max(peer.turnaround_s, TURNAROUND_FLOOR_S) / max(average, TURNAROUND_FLOOR_S)
        return min(max(relative, 1 / RATE_SPREAD), RATE_SPREAD) / peer.slots

    # -- the pool's blocked time -----------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Moves the clock to ``now``, charging the time since to the pool's reason (if peers waited on it)."""
        if now <= self._now:
            return
        if self.blocked is not None:
            self._blocked_s[WITHHELD.index(self.blocked)] += now - self._now
        self._now = now

    def _blocked_totals(self, now: float) -> tuple[float, ...]:
        totals = list(self._blocked_s)
        if self.blocked is not None and now > self._now:
            totals[WITHHELD.index(self.blocked)] += now - self._now
        return tuple(totals)
