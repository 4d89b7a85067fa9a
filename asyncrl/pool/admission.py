"""Admission and credits: which workers a pool serves, and how many leases each may hold.

The pool side of credit-based flow control, as a pure unit: a table of peers and the decisions over it, with no
socket and no thread of its own. The rollout channel's I/O thread (``asyncrl/transport/zmq.py``) tells it what
arrived (a HELLO, a status, a BYE, a group from an identity) and what time it is, sends what it decides (WELCOME or a
refusal, LEASES) and counts every decision under the reason given here.

- **Admission**: a HELLO registers a peer with its credits (``slots``, capped at ``gate.max_slots_per_peer``; none
  granted while it says it is not ``ready``: it still waits for the trainer's weights); at most
  ``gate.max_peers`` are served; a HELLO reusing a live worker's id is refused (``hello_refused_id_in_use``) and
  evicts it only once it has been silent for :data:`EVICT_AFTER_HEARTBEATS` heartbeats (a restarted process); a peer
  silent for ``transport.peer_timeout_s`` is dropped and its leases go back to the pool.
- **Credits**: each pass grants a peer leases up to its free credits, topped up in halves (a static worker) or at once
  (a streaming one); when the pool grants nothing, the pool's reason (:data:`WITHHELD`) is charged to every peer that
  wanted credits, as seconds.

Thread safety: the I/O thread makes every decision; :meth:`Admission.workers` may be read from another thread (the
trainer's ``stats()``), and the peer table is changed and read under :attr:`Admission.lock`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import GateConfig
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import Lease

__all__ = ["EVICT_AFTER_HEARTBEATS", "GREETED_PER_PEER", "MAX_STATUS_KEYS", "WITHHELD", "Admission", "Greeting",
           "Peer", "Refusal"]

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
    """The worker streams (continuous batching): every free credit is granted at once, not topped up in halves."""
    withheld_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WITHHELD, 0.0))
    """Seconds this worker asked for credits (it had free ones) and the pool granted none, by the pool's reason."""
    withheld: str | None = None
    """The pool's reason at the last grant pass (the time until the next pass is counted under it)."""
    ready: bool = True
    """False while the worker waits for the trainer's weights (HELLO ``ready: false``): greeted, granted nothing."""


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
        now: the clock's reading at start (the first grant pass charges no withheld time before it).
    """

    def __init__(self, pool: RolloutPool, gate: GateConfig, *, heartbeat_s: float, peer_timeout_s: float, now: float):
        self.pool = pool
        self.gate = gate
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.lock = threading.Lock()
        """Guards :attr:`peers` against a reader on another thread (the I/O thread is the only writer)."""
        self.peers: dict[bytes, Peer] = {}
        self.greeted: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        """Identity -> worker id of every identity welcomed, oldest first, bounded (SHUTDOWN is owed to each)."""
        self._granted_at = now

    # -- admission -------------------------------------------------------------------------------------------
    def hello(self, identity: bytes, body: dict[str, Any], now: float) -> Greeting:
        """A HELLO (``worker_id``, ``slots``, ``pid``, ``host``; optional ``streaming``, ``ready``) from ``identity``.

        A HELLO from a peer already registered on that connection under that id refreshes it (its credits, whether it
        is ready); ``ready: false`` greets a worker that waits for the trainer's weights: it is granted nothing until
        it greets again without it."""
        worker_id = body["worker_id"]
        greeting = Greeting()
        for other, p in list(self.peers.items()):
            if p.worker_id == worker_id and other != identity:
                if now - p.last_seen <= EVICT_AFTER_HEARTBEATS * self.heartbeat_s:
                    # a live worker keeps its id: a newcomer reusing it is refused (it may retry HELLO)
                    greeting.refusal = Refusal("hello_refused_id_in_use",
                                               f"worker id {worker_id!r} is in use by a live peer")
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
            return greeting
        greeting.joined = True
        greeting.peer = Peer(identity, worker_id, slots, body["pid"], body["host"][:128], now, now,
                             streaming=body.get("streaming") is True, ready=ready)
        with self.lock:
            self.peers[identity] = greeting.peer
        return greeting

    def worker_of(self, identity: bytes) -> str | None:
        """The worker id ``identity`` is served under, or greeted with (a peer reaped after a late heartbeat)."""
        peer = self.peers.get(identity)
        return peer.worker_id if peer is not None else self.greeted.get(identity)

    def status(self, peer: Peer, status: dict[str, Any]) -> Refusal | None:
        """Keeps a heartbeat's status (values cut to 200 characters), or says why it was refused (the previous one
        stays)."""
        if len(status) <= MAX_STATUS_KEYS and all(isinstance(k, str) and isinstance(v, (int, float, str))
                                                  for k, v in status.items()):
            peer.status = {k: v[:200] if isinstance(v, str) else v for k, v in status.items()}
            return None
        return Refusal("statuses_refused", f"a status of {len(status)} keys (at most {MAX_STATUS_KEYS}, values "
                                           "int/float/str) was ignored; the previous one stays")

    def drop(self, identity: bytes, reason: str) -> tuple[Peer, list[Lease]]:
        """Forgets a peer and gives its leases back to the pool: ``(peer, leases re-queued)``."""
        with self.lock:
            peer = self.peers.pop(identity)
        return peer, self.pool.release_worker(peer.worker_id, reason)

    def forget(self, identity: bytes) -> None:
        """``identity`` left (BYE) or cannot be reached: no SHUTDOWN is owed to it."""
        self.greeted.pop(identity, None)

    def silent(self, now: float) -> list[bytes]:
        """The peers not heard from for ``peer_timeout_s`` (dead: the caller drops them)."""
        return [identity for identity, p in self.peers.items() if now - p.last_seen > self.peer_timeout_s]

    def workers(self) -> dict[str, dict[str, Any]]:
        """Each peer as the receiver's ``stats()["workers"]`` shows it (any thread)."""
        with self.lock:
            return {p.worker_id: {"pid": p.pid, "host": p.host, "slots": p.slots, "groups": p.groups,
                                  **(p.status or {}),
                                  **{f"credits_withheld_{why}_s": round(v, 4) for why, v in p.withheld_s.items()}}
                    for p in self.peers.values()}

    # -- credits ---------------------------------------------------------------------------------------------
    def grants(self, now: float, skip: set[bytes] | frozenset[bytes] = frozenset()) -> list[tuple[Peer, list[Lease]]]:
        """One grant pass: the leases each peer gets now (peers in ``skip``, unreachable, and peers not ready get none).

        The time since the last pass is charged, as withheld, to each peer the pool withheld credits from then.
        A peer is topped up in batches (half its credits at once) unless it is about to run dry; a streaming peer
        gets every free credit at once (it refills a slot the moment a group leaves it). Once the pool grants
        nothing, nobody else gets any in this pass either, for the same reason.
        """
        dt, self._granted_at = min(now - self._granted_at, 1.0), now
        if not self.peers:
            return []
        held = self.pool.outstanding()
        out: list[tuple[Peer, list[Lease]]] = []
        blocked = None
        for identity, peer in list(self.peers.items()):
            if peer.withheld is not None:
                peer.withheld_s[peer.withheld] += dt
            peer.withheld = None
            if identity in skip or not peer.ready:
                continue
            free = peer.slots - held[peer.worker_id]
            if free <= 0 or (not peer.streaming and held[peer.worker_id] > 0 and free < max(1, peer.slots // 2)):
                continue
            if blocked is not None:
                peer.withheld = blocked
                continue
            leases = self.pool.grant(peer.worker_id, free, now)
            if not leases:
                blocked = peer.withheld = self.pool.withheld or "no_prompt"
                continue
            peer.withheld = self.pool.withheld  # fewer than its free credits: the rest withheld
            out.append((peer, leases))
        return out
