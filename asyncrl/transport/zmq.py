"""ZeroMQ backend of the rollout channel: both ends of the wire protocol.

Topology: each trainer rank's pool binds one ROUTER; each worker connects one DEALER per pool it
serves (M:N). Frames are :mod:`asyncrl.codec` messages (msgpack header + zero-copy tensor frames).

Who blocks on what:

* Pool side, :class:`ZmqRolloutReceiver`: one I/O thread owns the ROUTER. It blocks in a poll until a
  message, a wake-up from the trainer's thread or its next timer; decodes and checks every message (a bad
  one is counted and dropped, the peer stays) and feeds groups to the :class:`~asyncrl.pool.buffer.RolloutPool`.
  Grants follow events, not a tick: after the messages of one wake-up that can free or claim credits (a
  group, a failure, a HELLO, a BYE), after the trainer's thread changed what the pool may lease (a group
  taken, a version set, a commit, a reset: the pool's ``on_change`` wakes this thread) and after leases
  expire, one grant pass (:meth:`asyncrl.pool.admission.Admission.grants`) looks at the workers concerned.
  Timers: twice per ``heartbeat_s`` it expires overdue leases and declares silent workers dead (their leases
  go back to the ledger); once per ``heartbeat_s`` it sends heartbeats (encoded once for all) and re-reads
  every worker's leases from the pool. Idle, it wakes for those and for the workers' heartbeats only
  (which answer its own, so they arrive together). The trainer thread never touches the socket.
* Worker side, :class:`ZmqRolloutSender`: one I/O thread owns the DEALERs and handles handshake,
  heartbeats, leases and cancels; the worker's main thread blocks only in :meth:`take_leases` and
  hands finished groups to the I/O thread over an ``inproc`` PUSH/PULL pair (zero-copy), which wakes it.
  Otherwise it sleeps until its next timer: its heartbeat, a HELLO retry, a pool silent too long. It answers a
  pool's heartbeat with its own when that is due within half an interval, so an idle worker wakes about once per
  ``heartbeat_s`` and a pool's workers' heartbeats arrive together, read in one wake of the pool.

Credit-based flow control: a worker announces ``slots`` in HELLO (capped at ``gate.max_slots_per_peer``);
the pool keeps at most that many leases outstanding per worker and at most ``capacity`` groups in
flight overall, so a stalled trainer stops generation. Delivery is at-least-once (a lease can be
re-issued); the pool deduplicates by uid. Who is admitted and how many leases each gets is decided by
:class:`asyncrl.pool.admission.Admission` (no socket); this module moves the messages, owns the socket, its
monitor and CURVE, and counts every decision. Refused rollouts are kept for the debugger
(:mod:`asyncrl.transport._rejected`).

The gate (every refusal counted by reason in :meth:`ZmqRolloutReceiver.stats`): a group is accepted
only from a worker that holds or held a lease for its prompt in this epoch (``not_leased_to_peer``; a
group answering a lease of this worker that a reset cancelled is counted apart, ``cancelled_lease_answers``)
and only within :mod:`asyncrl.pool.gate`'s ranges (``gate_*``); a HELLO cannot evict a live worker by
reusing its id (``hello_refused_id_in_use``) and at most ``gate.max_peers`` workers are served
(``hello_refused_max_peers``); a message from a peer that never said HELLO gets no answer
(``messages_without_hello``), so a flood is not amplified; a peer that became unroutable is dropped at
once. With CURVE, only the worker keys of the pool's allow-list (``transport.curve_allowed_keys[_file]``, the file
watched, and :meth:`ZmqRolloutReceiver.authorize`) pass the ZAP handshake (``curve_keys_refused``); a key revoked
(:meth:`ZmqRolloutReceiver.revoke`, or left out of the rewritten file) is refused from then on: its worker is dropped
at once (``workers_revoked``, leases re-issued) and each further message it sends is refused
(``curve_key_revoked_messages``), checked against the key libzmq stamps on every message of a CURVE connection.
ZeroMQ drops a connection whose frame exceeds ``max_message_bytes`` without saying why; a socket
monitor counts every ended connection (``connections_dropped``) and failed handshake.

Shutdown: the pool sends SHUTDOWN to every worker it greeted and reads the socket until each answers
BYE (at most ``SHUTDOWN_ACK_S``) before closing it. A worker's DEALER has ``IMMEDIATE=1``, and libzmq
then terminates a disconnected peer's pipe at once, discarding messages the application has not read
yet: a pool that closed right after sending SHUTDOWN lost it whenever the worker's thread read late.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket as pysocket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from asyncrl._logging import Throttle
from asyncrl._zmq.curve import (
    AllowList,
    client_secret_key,
    generate_curve_keys,
    read_curve_keys_file,
    start_authenticator,
    write_curve_key_file,
)
from asyncrl._zmq.io import IOThread, Waker, drain, is_loopback_bind
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.config import GateConfig, TransportConfig
from asyncrl.pool.admission import GREETED_PER_PEER, Admission, Peer
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.gate import GateError, check_group
from asyncrl.pool.poison import CULPRITS
from asyncrl.rollout import Group
from asyncrl.transport import protocol as P
from asyncrl.transport._rejected import RejectedRollouts
from asyncrl.transport.base import HandshakeTimeout, PeerLost, ReceivedLease, RolloutReceiver, RolloutSender

__all__ = [
    "ZmqRolloutReceiver",
    "ZmqRolloutSender",
    "check_bind_address",
    "generate_curve_keys",
    "read_curve_keys_file",
    "write_curve_key_file",
]

logger = logging.getLogger(__name__)

HOUSEKEEPING_PER_HEARTBEAT = 2
"""The pool expires leases and reaps silent workers this often per ``heartbeat_s`` (and at least every half
``lease_timeout_s``)."""
SHUTDOWN_LINGER_MS = 1000
MAX_DRAIN = 256
ANSWERED_HEARTBEAT_SLACK = 1.1
"""After a pool's heartbeat, a worker's own heartbeat is due at least this many intervals later (the pool's next one
normally comes first, and is answered): its heartbeats stay at most 1.6 intervals apart."""
HELLO_RETRY_S = 0.005
"""A HELLO that could not leave (its connection is not made yet) is tried again after this, doubling up to
``heartbeat_s``: a worker started with its pool says HELLO as soon as the connection is up, not a heartbeat later."""
TIMER_EARLY_S = 0.005
"""A worker's heartbeat timer due within this many seconds counts as due (a poll's timeout may end that early)."""
REGREET_AFTER_HEARTBEATS = 2.5
"""A worker that has heard nothing from a pool for this many ``heartbeat_s`` says HELLO again."""
SHUTDOWN_ACK_S = 2.0
"""Longest a closing pool waits for its workers' BYE after SHUTDOWN (it reads the socket meanwhile)."""
_MONITOR_EVENTS = {
    zmq.EVENT_ACCEPTED: "connections_accepted",
    zmq.EVENT_DISCONNECTED: "connections_dropped",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshakes_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshakes_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshakes_failed_auth",
}


def check_bind_address(config: TransportConfig) -> None:
    """Refuses a non-loopback TCP bind without CURVE unless explicitly allowed.

    Raises:
        ValueError: naming the settings that fix it.
    """
    if not is_loopback_bind(config.bind) and config.curve_secret_key is None and not config.allow_insecure_remote:
        raise ValueError(
            f"refusing to bind {config.bind!r} beyond loopback without authentication: set "
            "transport.curve_secret_key/curve_public_key (asyncrl.transport.zmq.generate_curve_keys) "
            "or transport.allow_insecure_remote=True on a trusted network"
        )


class ZmqRolloutReceiver(RolloutReceiver):
    """Pool-side end: a ROUTER served by one I/O thread.

    Args:
        config: transport settings.
        pool: the pool fed by this receiver.
        prompt_fn: ``prompt_index -> prompt`` (msgpack-able), sent with each lease.
        rank: the trainer rank of the pool.
        world_size: number of trainer ranks.
        gate: what is admitted from workers (ranges, per-peer caps); default :class:`GateConfig`.

    Raises:
        ValueError: for a non-loopback bind without CURVE, or a CURVE pool without an allow-list of worker
            keys (``transport.curve_allowed_keys[_file]``, or ``transport.curve_allow_any_client``).
    """

    def __init__(
        self,
        config: TransportConfig,
        pool: RolloutPool,
        prompt_fn: Callable[[int], Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        gate: GateConfig | None = None,
    ):
        check_bind_address(config)
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self.allow_list = AllowList.from_config(config, count=self._count)
        """The worker keys admitted (CURVE): :meth:`authorize` / :meth:`revoke` change it while the pool runs."""
        listed = config.curve_allowed_keys or config.curve_allowed_keys_file is not None
        if config.curve_secret_key is not None and not listed and not config.curve_allow_any_client:
            raise ValueError(
                "a CURVE pool needs an allow-list of worker public keys: set transport.curve_allowed_keys or "
                "transport.curve_allowed_keys_file (asyncrl.transport.zmq.write_curve_key_file makes a "
                "worker's key), or transport.curve_allow_any_client=True to serve any key"
            )
        self.gate = gate or GateConfig()
        self.config = config
        self.pool = pool
        self.prompt_fn = prompt_fn
        self.rank = rank
        self.world_size = world_size
        self._io = IOThread(self, f"asyncrl-receiver-rank{rank}")
        self._ctx, self._stop = self._io.ctx, self._io.stop
        self._ready = threading.Event()
        self._cancel = threading.Event()
        self._shutdown_workers = True
        self._endpoint: str | None = None
        self._start_error: BaseException | None = None
        self._recent_errors: collections.deque[tuple[str, str]] = collections.deque(maxlen=32)
        self._rejected = RejectedRollouts()  # for the debugger
        self._throttle = Throttle(logger)  # repeated warnings (a prompt failing on every worker)
        self.admission = Admission(pool, self.gate, heartbeat_s=config.heartbeat_s,
                                   peer_timeout_s=config.peer_timeout_s, now=time.monotonic())
        """Who is served and how many leases each gets (the pool's policy; this end only moves the messages)."""
        self._unroutable: set[bytes] = set()  # identities whose last send failed as unroutable (I/O thread)
        self._waker = Waker(self._ctx, f"receiver-rank{rank}", coalesce=True)
        """Wakes the I/O thread: the pool's ``on_change`` (the trainer's thread), a cancel, close."""
        self._dirty = True  # something may let a grant pass lease more (I/O thread)
        self._check_keys = config.curve_secret_key is not None and not config.curve_allow_any_client
        self._peer_keys: dict[bytes, str] = {}  # identity -> the CURVE key it greeted with (I/O thread)
        self._keys_version = self.allow_list.version

    # -- public --------------------------------------------------------------------------------
    def start(self) -> str:
        if not self._io.started:
            self._io.start(self._run)
            if not self._ready.wait(30):
                raise TimeoutError(f"rollout receiver did not bind {self.config.bind} within 30 s")
            if self._start_error is not None:
                raise RuntimeError(f"rollout receiver could not bind {self.config.bind!r}") from self._start_error
        assert self._endpoint is not None
        return self._endpoint

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("receiver not started; call start() first")
        return self._endpoint

    def authorize(self, key: str) -> None:
        """Admits the worker public key ``key`` (Z85) from now on (a worker about to join)."""
        self.allow_list.authorize(key)

    def revoke(self, key: str) -> None:
        """Refuses ``key`` from now on: a worker connected with it is dropped at once (its leases re-issued), and
        its further messages and handshakes are refused and counted (``curve_key_revoked_messages``,
        ``curve_keys_refused``)."""
        self.allow_list.revoke(key)
        self._waker.wake()

    def cancel_all(self) -> None:
        self._cancel.set()
        self._waker.wake()

    def ready_workers(self) -> int:
        return self.admission.ready_workers()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["recent_errors"] = list(self._recent_errors)
        out["workers"] = self.admission.workers(time.monotonic())
        return out

    def close(self, shutdown_workers: bool = True) -> None:
        self._shutdown_workers = shutdown_workers
        # joins the I/O thread (woken: it waits for events, not a tick), which closes its sockets; then the context
        self._io.close(before_join=self._waker.wake if self._io.started else None)

    # -- I/O thread ----------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _bad(self, identity: bytes, error: DecodeError) -> None:
        with self._lock:
            self._counters["bad_messages"] += 1
            peer = self.admission.peers.get(identity)
            who = peer.worker_id if peer is not None else identity.hex()
            self._recent_errors.append((who, str(error)[:300]))
        if self._counters["bad_messages"] <= 10 or self._counters["bad_messages"] % 1000 == 0:
            logger.warning("rank %d: rejected message from peer %s: %s", self.rank, identity.hex(), error)

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise instead of vanishing
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if self.config.curve_secret_key is not None:
            sock.curve_secretkey = self.config.curve_secret_key.encode()
            sock.curve_publickey = self.config.curve_public_key.encode()  # type: ignore[union-attr]
            sock.curve_server = True
        sock.bind(self.config.bind)
        return sock

    def _start_auth(self) -> Any:
        """The ZAP handler of a CURVE pool (before bind: libzmq asks it at every CURVE handshake)."""
        if self.config.curve_secret_key is None:
            return None
        return start_authenticator(self._ctx, None if self.config.curve_allow_any_client else self.allow_list,
                                   self._count)

    def _run(self) -> None:
        auth = monitor = None
        try:
            auth = self._start_auth()
            sock = self._open()
            monitor = sock.get_monitor_socket(sum(_MONITOR_EVENTS))
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # reported to start() in the caller's thread
            self._start_error = e
            self._ready.set()
            if auth is not None:
                auth.stop()
            return
        self._ready.set()
        wake = None
        try:
            wake = self._waker.pull()
            self.pool.on_change = self._waker.wake
            self._loop(sock, monitor, wake)
        except BaseException as e:  # thread boundary: the trainer's next() re-raises it
            logger.exception("rank %d: rollout receiver died", self.rank)
            self.pool.fail(e)
        finally:
            if self.pool.on_change == self._waker.wake:
                self.pool.on_change = None
            self._waker.close()  # here, under its lock: its sending end must be closed before the context's term
            if wake is not None:
                wake.close(linger=0)
            said_goodbye = self._say_shutdown(sock) if self._shutdown_workers else False
            sock.disable_monitor()
            monitor.close(linger=0)
            # linger=0 would drop SHUTDOWNs still queued in libzmq; give them a bounded moment to leave.
            sock.close(linger=SHUTDOWN_LINGER_MS if said_goodbye else 0)
            if auth is not None:
                auth.stop()

    def _say_shutdown(self, sock: zmq.Socket) -> bool:
        """SHUTDOWN to every worker greeted (reaped ones included: they may re-join) and to any identity heard
        from meanwhile (a worker whose connection was re-made), then reads the socket until each answers BYE,
        at most ``SHUTDOWN_ACK_S``. The wait matters: a worker's DEALER has ``IMMEDIATE=1``, with which
        libzmq drops a disconnected pipe's unread messages, so a SHUTDOWN still unread when the pool closed
        the connection was lost (seen under load: the worker waited, then exited with PeerLost; 2 of 30 runs
        of test_worker_serves_the_pools_that_answer with a core busy). Returns whether any SHUTDOWN left."""
        told = {identity for identity in [*self.admission.greeted, *self.admission.peers]
                if self._send(sock, identity, P.SHUTDOWN, {})}
        waiting = set(told)
        deadline = time.monotonic() + SHUTDOWN_ACK_S

        def on_message(frames: list[zmq.Frame]) -> None:
            identity = frames[0].bytes
            try:
                kind, _ = decode(frames[1:], max_message_bytes=self.config.max_message_bytes)
            except DecodeError:
                return
            if kind == P.BYE:
                waiting.discard(identity)
            elif identity not in told and len(told) < GREETED_PER_PEER * self.gate.max_peers:
                if self._send(sock, identity, P.SHUTDOWN, {}):
                    told.add(identity)
                    waiting.add(identity)

        while waiting and (remaining := deadline - time.monotonic()) > 0:
            if sock.poll(max(1, int(min(remaining, 0.05) * 1000))):
                drain(sock, on_message, MAX_DRAIN)
        self._count("shutdown_unacknowledged", len(waiting))
        return bool(told)

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        housekeeping_s = min(self.config.heartbeat_s, self.pool.ledger.lease_timeout_s) / HOUSEKEEPING_PER_HEARTBEAT
        now = time.monotonic()
        next_heartbeat, next_housekeeping = now, now + housekeeping_s
        while not self._stop.is_set():
            timer = min(next_heartbeat, next_housekeeping)
            if self.admission.blocked == "no_prompt" and (retry := self.pool.next_wake()) is not None:
                timer = min(timer, retry)  # a failed prompt's backoff ends: it can be leased again
            events = dict(poller.poll(0 if self._dirty else max(0, math.ceil((timer - now) * 1000))))
            self._count("io_wakes")
            if wake in events:  # the trainer's side changed what the pool may lease (or a cancel, or close)
                self._waker.drain(wake)
                self._dirty = True
            if sock in events:
                drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
            if monitor in events:
                drain(monitor, self._monitor_event, MAX_DRAIN)
            now = time.monotonic()
            if self._cancel.is_set():
                self._cancel.clear()
                # only leases older than the pool's timeline: ones granted since the reset stay valid
                for identity in list(self.admission.peers):
                    self._send(sock, identity, P.CANCEL, {"min_lease_id": self.pool.min_lease_id})
                self.admission.touch_all()  # the reset took every lease back
                self._dirty = True
            if now >= next_housekeeping:  # deadlines are seconds; no need to scan more often
                next_housekeeping = now + housekeeping_s
                self._housekeeping(now)
                if self._check_keys:
                    self.allow_list.refresh()  # a watched allow-list file rewritten: authorize / revoke
            if self._check_keys:
                self._drop_revoked()
            if now >= next_heartbeat:
                next_heartbeat = now + self.config.heartbeat_s
                frames = encode(P.HEARTBEAT, {"policy_version": self.pool.policy_version,
                                              "incarnation": self.pool.incarnation})  # once for every worker
                for identity in list(self.admission.peers):
                    self._send(sock, identity, P.HEARTBEAT, frames=frames)
                # and every worker's leases re-read from the pool (those it cancelled on its own: a duplicate group's,
                # a skipped prompt's)
                self.admission.touch_all()
                self._dirty = True
            if self._dirty or timer <= now:
                self._dirty = False
                self._grant(sock, now)
            self._drop_unroutable()

    def _housekeeping(self, now: float) -> None:
        """Expires overdue leases and drops silent workers (their leases go back to the pool)."""
        expired = self.pool.expire(now)
        if expired:
            self._count("leases_expired", len(expired))
            for lease in expired:
                self.admission.touch_worker(lease.worker_id)
            self._dirty = True
        self._reap(now)

    def _monitor_event(self, frames: list[zmq.Frame]) -> None:
        event = int.from_bytes(frames[0].bytes[:2], "little")
        name = _MONITOR_EVENTS.get(event)
        if name is not None:
            self._count(name)

    def _send(self, sock: zmq.Socket, identity: bytes, kind: str, body: dict[str, Any] | None = None, *,
              frames: list | None = None) -> bool:
        """Sends ``body`` (or ``frames`` already encoded) to ``identity``; False if it cannot be sent now."""
        try:
            sock.send_multipart([identity, *(frames if frames is not None else encode(kind, body))], zmq.NOBLOCK,
                                copy=False)
            return True
        except (zmq.Again, zmq.ZMQError) as e:  # peer gone (ROUTER_MANDATORY) or its queue is full
            self._count(f"send_failed_{kind}")
            if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
                self._unroutable.add(identity)  # its connection is gone: dropped after this pass
            logger.debug("rank %d: cannot send %s to %s: %s", self.rank, kind, identity.hex(), e)
            return False

    def _drop_unroutable(self) -> None:
        """Peers whose connection is gone are dropped at once (their leases re-issued), and forgotten."""
        for identity in self._unroutable:
            self.admission.forget(identity)
            if identity in self.admission.peers:
                self._count("peers_unroutable")
                self._drop_peer(identity, "workers_lost")
                self._dirty = True
        self._unroutable.clear()

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        self._count("messages")
        if self._check_keys and not self._key_admitted(identity, frames[-1]):
            return
        try:
            kind, body = decode(frames[1:], max_message_bytes=self.config.max_message_bytes)
            P.check_body(kind, body, P.WORKER_KINDS)
        except DecodeError as e:
            self._bad(identity, e)
            return
        now = time.monotonic()
        peer = self.admission.peers.get(identity)
        if peer is not None:
            peer.last_seen = now
        elif kind not in (P.HELLO, P.GROUP) and identity not in self.admission.greeted:
            # never said HELLO (or so long ago that it was forgotten): no answer, so a flood is not amplified
            # (a GROUP goes on to be judged and counted: a forgery is counted as one, and not answered either)
            self._count("messages_without_hello")
            return
        if kind == P.HELLO:
            self._hello(sock, identity, body, now)
        elif kind == P.GROUP:
            self._group(sock, identity, peer, body)
        elif kind == P.FAILED:
            self._count("leases_failed")
            who = peer.worker_id if peer is not None else identity.hex()
            self._throttle.warning("failed", "rank %d: worker %s failed lease %d: %s", self.rank, who,
                                   body["lease_id"], body["error"][:500])
            if peer is not None:  # counted against the prompt; poisoned after loader.max_prompt_failures
                culprit = body.get("culprit")  # optional (older workers send none); an unknown one is not trusted
                self.pool.lease_failed(body["lease_id"], peer.worker_id, body["error"][:2000],
                                       culprit=culprit if culprit in CULPRITS else "unknown")
                self.admission.returned(peer, body["lease_id"], now, accepted=False)
                self._dirty = True
        elif kind == P.BYE:
            self.admission.forget(identity)  # it left: no SHUTDOWN owed
            if peer is not None:
                self._drop_peer(identity, "worker_left")
                self._dirty = True  # its leases went back to the pool
        elif peer is None:  # heartbeat from a worker we greeted and then declared dead: it greets again
            self._send(sock, identity, P.RESYNC, {})
        elif kind == P.HEARTBEAT and isinstance(body.get("status"), dict):
            refusal = self.admission.status(peer, body["status"])
            if refusal is not None:  # the previous status stays; a status grown past the limit must not go unnoticed
                self._refused(identity, refusal.reason, refusal.error, peer.worker_id)

    def _key_admitted(self, identity: bytes, frame: zmq.Frame) -> bool:
        """Whether the CURVE key libzmq stamped on this message (the ZAP ``User-Id``: the Z85 public key the
        connection authenticated with) is still admitted; a revoked key's message is refused and counted, and its
        peer dropped (leases re-issued)."""
        key = frame.get("User-Id")
        self._peer_keys.setdefault(identity, key)
        if self.allow_list.admits(key):
            return True
        self._count("curve_key_revoked_messages")
        self._refuse_revoked(identity)
        return False

    def _drop_revoked(self) -> None:
        """After a revoke (the allow-list's version moved): every peer whose key is no longer admitted is dropped at
        once, its leases re-issued, whether or not it sends anything more."""
        if self.allow_list.version == self._keys_version:
            return
        self._keys_version = self.allow_list.version
        for identity, key in list(self._peer_keys.items()):
            if not self.allow_list.admits(key):
                self._refuse_revoked(identity)

    def _refuse_revoked(self, identity: bytes) -> None:
        """A connection whose key was revoked: its peer dropped (leases re-issued), no SHUTDOWN owed to it."""
        if identity in self.admission.peers:
            self._drop_peer(identity, "workers_revoked")
            self._dirty = True
        self._peer_keys.pop(identity, None)
        self.admission.forget(identity)

    def _hello(self, sock: zmq.Socket, identity: bytes, body: dict[str, Any], now: float) -> None:
        greeting = self.admission.hello(identity, body, now)
        self._dirty = True
        for old, released in greeting.evicted:
            self._dropped(old, "worker_restarted", released)
        if greeting.refusal is not None:
            self._refused(identity, greeting.refusal.reason, greeting.refusal.error)
            return
        if greeting.capped:
            self._count("slots_capped")
        if greeting.joined:
            self._count("workers_joined")
            logger.info("rank %d: worker %s joined (pid %d on %s%s)", self.rank, body["worker_id"], body["pid"],
                        body["host"], "" if greeting.peer.ready else "; waiting for weights")
        self._send(
            sock,
            identity,
            P.WELCOME,
            {
                "rank": self.rank,
                "world_size": self.world_size,
                "group_size": self.pool.group_size,
                "heartbeat_s": self.config.heartbeat_s,
                "peer_timeout_s": self.config.peer_timeout_s,
                "policy_version": self.pool.policy_version,
                "incarnation": self.pool.incarnation,
            },
        )

    def _refused(self, identity: bytes, reason: str, error: str, worker_id: str | None = None) -> None:
        """Counts a refusal under ``reason``; the first few and then every power of two go to recent_errors
        (a storm of refusals must not push every other error out)."""
        with self._lock:
            self._counters[reason] += 1
            n = self._counters[reason]
            if n <= 4 or n & (n - 1) == 0:
                self._recent_errors.append((worker_id or identity.hex(), f"{reason}: {error}"[:300]))
        if n <= 4 or n & (n - 1) == 0:
            who = worker_id or identity.hex()
            logger.warning("rank %d: refused peer %s (%s, %d so far): %s", self.rank, who, reason, n, error)

    def _group(self, sock: zmq.Socket, identity: bytes, peer: Peer | None, body: dict[str, Any]) -> None:
        lease_id = body["lease_id"]
        # a peer reaped after a late heartbeat is still known by the id it greeted with
        worker_id = self.admission.worker_of(identity)
        try:
            group = Group.from_wire(body["group"], group_size=self.pool.group_size)
            check_group(group, self.gate)
        except GateError as e:
            self._refused(identity, f"gate_{e.reason}", str(e), worker_id)
            self._count("groups_refused")
            self._rejected.keep(worker_id, body["group"], e)
            if peer is not None:  # its lease is void: generate the prompt again elsewhere
                self.pool.release_held(lease_id, peer.worker_id, "rejected")
                self.admission.returned(peer, lease_id, time.monotonic(), accepted=False)
                self._dirty = True
            return
        except DecodeError as e:
            self._bad(identity, e)
            self._rejected.keep(worker_id, body["group"])
            if peer is not None:  # its lease is void: generate the prompt again elsewhere
                self.pool.release_held(lease_id, peer.worker_id, "rejected")
                self.admission.returned(peer, lease_id, time.monotonic(), accepted=False)
                self._dirty = True
            return
        if worker_id is not None and self.pool.cancelled_lease_of(lease_id, worker_id):
            self._count("cancelled_lease_answers")  # late, not forged: a reset cancelled the lease it answers
            if peer is None:
                self._send(sock, identity, P.RESYNC, {})
            else:
                self.admission.returned(peer, lease_id, time.monotonic(), accepted=False)
            return
        if worker_id is None or not self.pool.held_by(group.epoch, group.prompt_index, worker_id):
            self._refused(
                identity,
                "not_leased_to_peer",
                f"group {group.group_id} (lease {lease_id}) from a peer that holds no lease for it",
                worker_id,
            )
            self._count("groups_refused")
            if peer is None and worker_id is not None:  # greeted once, then declared dead: it greets again
                self._send(sock, identity, P.RESYNC, {})
            return
        accepted = self.pool.add_rollouts(group.rollouts, lease_id=lease_id)
        self._count("groups_received")
        if peer is None:
            self._send(sock, identity, P.RESYNC, {})
        else:
            peer.groups += accepted > 0
            self.pool.release_held(lease_id, peer.worker_id, "rejected")
            self.admission.returned(peer, lease_id, time.monotonic(), accepted=accepted > 0)
            self._dirty = True

    def rejected_rollouts(self) -> list[dict[str, Any]]:
        return self._rejected.list()

    def _drop_peer(self, identity: bytes, reason: str) -> None:
        self._peer_keys.pop(identity, None)  # a message it still sends is checked on its own key (_key_admitted)
        peer, released = self.admission.drop(identity, reason)
        self._dropped(peer, reason, released)

    def _dropped(self, peer: Peer, reason: str, released: list[Any]) -> None:
        self._count(reason)
        logger.info("rank %d: worker %s gone (%s); %d leases re-queued", self.rank, peer.worker_id, reason,
                    len(released))

    def _reap(self, now: float) -> None:
        for identity in self.admission.silent(now):
            self._drop_peer(identity, "workers_lost")
            self._dirty = True

    def _grant(self, sock: zmq.Socket, now: float) -> None:
        for peer, leases in self.admission.grants(now, skip=self._unroutable):
            body = {
                "policy_version": self.pool.policy_version,
                "incarnation": self.pool.incarnation,
                "leases": [
                    {
                        "lease_id": lease.lease_id,
                        "epoch": lease.epoch,
                        "prompt_index": lease.prompt_index,
                        "attempt": lease.attempt,
                        "group_size": self.pool.group_size,
                        "prompt": self.prompt_fn(lease.prompt_index),
                    }
                    for lease in leases
                ],
            }
            if not self._send(sock, peer.identity, P.LEASES, body):
                # never reached the worker: not a regeneration, and first in line for the next worker
                self.pool.undeliver(leases)
                self.admission.undelivered(peer, leases)
                self._count("leases_undeliverable", len(leases))
                self._dirty = True
            else:
                self._count("leases_granted", len(leases))


class ZmqRolloutSender(RolloutSender):
    """Worker-side end: one DEALER per pool, owned by an I/O thread.

    Args:
        config: transport settings (heartbeats, timeouts, limits).
        endpoints: the pools to serve, one per trainer rank.
        worker_id: unique name of this worker (the pool re-issues the leases of a reused id).
        slots: credits per pool: leases held at once.
        streaming: the worker streams (``worker.streaming``): said in HELLO, the pool then grants each free credit
            at once instead of topping up in halves.
        server_key: the pools' CURVE public key, when they use CURVE; this worker's own key pair comes from
            ``transport.curve_client_secret_key`` or ``transport.curve_client_key_file``.
    """

    def __init__(
        self,
        config: TransportConfig,
        endpoints: Sequence[str],
        *,
        worker_id: str,
        slots: int,
        server_key: str | None = None,
        streaming: bool = False,
        ready: bool = True,
    ):
        if not endpoints:
            raise ValueError("a worker needs at least one pool endpoint to connect to")
        self.config = config
        self.endpoints = list(endpoints)
        self.worker_id = worker_id
        self.slots = slots
        self.server_key = server_key
        self.streaming = streaming
        self._ready = ready
        self._greet_again = threading.Event()  # set_ready(): the I/O thread says HELLO again on every connection
        self._pool_heartbeat = False  # a pool's heartbeat arrived in this wake (I/O thread)
        secret = client_secret_key(config)
        # the pool's allow-list names this worker's public key; without a configured key, a throw-away pair
        self._client_keys: tuple[bytes, bytes] = (
            (zmq.curve_public(secret.encode()), secret.encode()) if secret is not None else zmq.curve_keypair()
        )
        self._io = IOThread(self, f"asyncrl-sender-{worker_id}")
        self._ctx, self._stop = self._io.ctx, self._io.stop
        self._waker = Waker(self._ctx, f"sender-{id(self):x}", coalesce=True)  # set_ready() and close()
        self._out_addr = f"inproc://asyncrl-out-{id(self):x}"
        self._cv = threading.Condition()
        self._leases: collections.deque[ReceivedLease] = collections.deque()
        self._welcomed = [False] * len(endpoints)
        self._shutdown = [False] * len(endpoints)
        self._lost = [False] * len(endpoints)
        self._abandoned = [False] * len(endpoints)  # never welcomed within handshake_timeout_s
        self._pending: list[collections.deque] = [collections.deque() for _ in endpoints]
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._pusher: zmq.Socket | None = None
        self.policy_version = 0
        self.incarnation = ""
        """The live trainer incarnation, as the pools last said (WELCOME, LEASES, HEARTBEAT)."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.status: dict[str, int | float | str] = {}
        """Reported to every pool with each heartbeat (engine policy version, weight-sync failures, ...)."""

    # -- main thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._io.start(self._run)
        # Serve as soon as one pool answers; the I/O thread keeps greeting the others until
        # handshake_timeout_s and then gives up on them (a rank that already finished, say).
        deadline = time.monotonic() + self.config.handshake_timeout_s
        with self._cv:
            while not any(self._welcomed) and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
        if self._error is not None:
            self.close()
            raise self._error
        if not any(self._welcomed):
            self.close()
            raise HandshakeTimeout(
                f"worker {self.worker_id}: no WELCOME from {self.endpoints} within {self.config.handshake_timeout_s} s; "
                "check the address and that the trainer is running (transport.handshake_timeout_s)"
            )
        self._bound.wait()
        self._pusher = self._ctx.socket(zmq.PUSH)
        self._pusher.setsockopt(zmq.LINGER, -1)
        self._pusher.connect(self._out_addr)

    def take_leases(self, max_leases: int, timeout: float) -> list[ReceivedLease]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._leases and self._error is None and not self.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cv.wait(remaining)
            if self._error is not None:
                raise self._error
            out = []
            while self._leases and len(out) < max_leases:
                out.append(self._leases.popleft())
            return out

    def send_group(self, lease: ReceivedLease, group: Group) -> None:
        self._push(lease.conn, encode(P.GROUP, {"lease_id": lease.lease_id, "group": group.to_wire()}))

    def send_failed(self, lease: ReceivedLease, error: str, culprit: str | None = None) -> None:
        body = {"lease_id": lease.lease_id, "error": error[:2000], **({"culprit": culprit} if culprit else {})}
        self._push(lease.conn, encode(P.FAILED, body))

    def _push(self, conn: int, frames: list) -> None:
        if self._pusher is None:
            raise RuntimeError("sender not started")
        self._pusher.send_multipart([b"%d" % conn, *frames], copy=False)

    def set_ready(self) -> None:
        self._ready = True
        self._greet_again.set()
        self._waker.wake()

    @property
    def done(self) -> bool:
        """Every pool said SHUTDOWN (pools that never answered the handshake are not waited for)."""
        return any(self._shutdown) and all(sd or ab for sd, ab in zip(self._shutdown, self._abandoned))

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()  # LINGER -1: everything pushed reaches the I/O thread first
            self._pusher = None
        # the I/O thread waits for events, not a tick: wake it to see the stop
        self._io.close(before_join=self._waker.wake if self._io.started else None)

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._out_addr)
        wake = self._waker.pull()
        self._bound.set()
        dealers = [self._dealer(ep) for ep in self.endpoints]
        try:
            self._loop(pull, dealers, wake)
        except BaseException as e:  # thread boundary: take_leases() re-raises it in the main thread
            logger.exception("worker %s: sender I/O thread died", self.worker_id)
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            self._waker.close()  # here, under its lock: its sending end must be closed before the context's term
            wake.close(linger=0)
            self._drain(pull, dealers)
            for i, d in enumerate(dealers):
                if not self._shutdown[i] and not self._lost[i]:
                    self._send(d, P.BYE, {})
                d.close(linger=2000)  # let groups already queued reach the pool
            pull.close(linger=0)

    def _dealer(self, endpoint: str) -> zmq.Socket:
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a pool that is not connected
        d.setsockopt(zmq.SNDHWM, self.config.hwm)
        d.setsockopt(zmq.RCVHWM, self.config.hwm)
        d.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if self.server_key is not None:
            public, secret = self._client_keys
            d.curve_serverkey = self.server_key.encode()
            d.curve_publickey, d.curve_secretkey = public, secret
        d.connect(endpoint)
        return d

    def _hello(self, d: zmq.Socket) -> bool:
        body = {
            "worker_id": self.worker_id,
            "slots": self.slots,
            "pid": os.getpid(),
            "host": pysocket.gethostname(),
            "protocol": P.PROTOCOL_VERSION,
        }
        if self.streaming:
            body["streaming"] = True
        if not self._ready:
            body["ready"] = False
        return self._send(d, P.HELLO, body)

    def _send(self, d: zmq.Socket, kind: str, body: dict[str, Any]) -> bool:
        return self._send_frames(d, kind, encode(kind, body))

    def _send_frames(self, d: zmq.Socket, kind: str, frames: list) -> bool:
        """Whether the message left; it does not while the connection is not made yet (``IMMEDIATE``) or its queue
        is full (heartbeats and hellos are retried anyway)."""
        try:
            d.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.counters[f"send_dropped_{kind}"] += 1
            return False
        return True

    def _drain(self, pull: zmq.Socket, dealers: list[zmq.Socket], ready: bool = True) -> None:
        """Forwards groups from the main thread (when ``ready``: the poll saw some); never blocks (heartbeats must
        keep flowing)."""
        for conn, d in enumerate(dealers):
            if self._pending[conn]:
                self._flush(conn, d)
        if not ready:
            return
        for _ in range(100_000):
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            conn = int(frames[0].bytes)
            self._pending[conn].append(frames[1:])
            self._flush(conn, dealers[conn])

    def _flush(self, conn: int, d: zmq.Socket) -> None:
        pending = self._pending[conn]
        while pending:
            if self._shutdown[conn] or self._lost[conn] or self._abandoned[conn]:
                # that pool is gone: its leases are re-issued by the ledger (or by a resumed run)
                self.counters["groups_dropped_pool_gone"] += len(pending)
                pending.clear()
                return
            try:
                d.send_multipart(pending[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:  # pool's queue full or reconnecting: retry on the next loop
                return
            pending.popleft()

    def _loop(self, pull: zmq.Socket, dealers: list[zmq.Socket], wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        for d in dealers:
            poller.register(d, zmq.POLLIN)
        n = len(dealers)
        hb = self.config.heartbeat_s
        now = time.monotonic()
        handshake_deadline = now + self.config.handshake_timeout_s
        last_seen = [now] * n
        next_hello = [0.0] * n
        regreet = [False] * n  # set_ready() since the last HELLO on this connection: greet it as soon as welcomed
        hello_retry = [HELLO_RETRY_S] * n  # a HELLO the unmade connection refused is retried after this (doubling)
        next_heartbeat = now + hb
        wake_at = now
        while not self._stop.is_set():
            # a pool's message, groups to send and set_ready()/close() wake it; otherwise only its next timer
            events = dict(poller.poll(max(0, math.ceil((wake_at - time.monotonic()) * 1000))))
            self.counters["io_wakes"] += 1
            if wake in events:
                self._waker.drain(wake)
            self._drain(pull, dealers, pull in events)
            now = time.monotonic()
            if self._greet_again.is_set():  # kept per connection: one not welcomed yet is greeted when it is
                self._greet_again.clear()
                regreet = [True] * n
            self._pool_heartbeat = False
            wake_at = math.inf  # the earliest timer, below (the heartbeat last: a pool's may move it)
            for i, d in enumerate(dealers):
                if d in events and drain(d, lambda frames, i=i, d=d: self._handle(i, d, frames), MAX_DRAIN):
                    last_seen[i] = now
                    self._lost[i] = False
                if not self._welcomed[i] and not self._abandoned[i]:
                    if now >= next_hello[i]:
                        if now > handshake_deadline:
                            self._abandoned[i] = True
                            logger.warning("worker %s: no WELCOME from %s within %s s (transport.handshake_timeout_s); "
                                           "not serving it", self.worker_id, self.endpoints[i],
                                           self.config.handshake_timeout_s)
                            continue
                        if self._hello(d):  # it says whether this worker is ready now
                            next_hello[i], hello_retry[i] = now + hb, HELLO_RETRY_S
                        else:  # the connection is not made yet (IMMEDIATE): try again soon, backing off to hb
                            next_hello[i], hello_retry[i] = now + hello_retry[i], min(hb, 2 * hello_retry[i])
                        regreet[i] = False
                    wake_at = min(wake_at, next_hello[i])
                if not self._welcomed[i] or self._shutdown[i]:
                    continue
                regreet_at = max(last_seen[i] + REGREET_AFTER_HEARTBEATS * hb, next_hello[i])
                if regreet[i] or now >= regreet_at:
                    # ready now; or the pool has been silent: it may know this connection under another identity
                    # (a reconnect) and answers nothing to a peer that never said HELLO on it
                    self._hello(d)
                    next_hello[i] = now + hb
                    regreet[i] = False
                    regreet_at = max(regreet_at, next_hello[i])
                if now - last_seen[i] > self.config.peer_timeout_s:
                    self._lost[i] = True
                wake_at = min(wake_at, regreet_at)
                if not self._lost[i]:
                    wake_at = min(wake_at, last_seen[i] + self.config.peer_timeout_s + 0.001)
            # a pool's heartbeat is answered at once when ours is due within half an interval: one wake for both.
            # After a pool's heartbeat our own timer waits a little longer than an interval, so that the pool's next
            # heartbeat (an interval later, plus its own delays) comes first and is answered in its wake; on an
            # interval of our own, the two would alternate and wake this thread twice per heartbeat. (A poll's
            # timeout may end a few milliseconds early: a timer due that soon counts as due.)
            answered = self._pool_heartbeat and now >= next_heartbeat - hb / 2
            if now + TIMER_EARLY_S >= next_heartbeat or answered:
                next_heartbeat = now + hb
                frames = encode(P.HEARTBEAT, {"status": dict(self.status)})
                for i, d in enumerate(dealers):
                    if self._welcomed[i] and not self._shutdown[i]:
                        self._send_frames(d, P.HEARTBEAT, frames)
            if self._pool_heartbeat:
                next_heartbeat = max(next_heartbeat, now + hb * ANSWERED_HEARTBEAT_SLACK)
            wake_at = min(wake_at, next_heartbeat)
            if any(self._pending):  # groups a full queue held back: retried soon
                wake_at = min(wake_at, now + 0.02)
            live = [i for i in range(n) if self._welcomed[i] and not self._shutdown[i]]
            if live and all(self._lost[i] for i in live) and not any(
                not self._welcomed[i] and not self._abandoned[i] for i in range(n)
            ):
                raise PeerLost(
                    f"worker {self.worker_id}: pools {[self.endpoints[i] for i in live]} silent for more than "
                    f"{self.config.peer_timeout_s} s (transport.peer_timeout_s)"
                )
            if self.done:
                with self._cv:
                    self._cv.notify_all()

    def _handle(self, conn: int, d: zmq.Socket, frames: list[zmq.Frame]) -> None:
        try:
            kind, body = decode(frames, max_message_bytes=self.config.max_message_bytes)
            P.check_body(kind, body, P.POOL_KINDS)
            leases = self._leases_of(conn, body) if kind == P.LEASES else []
        except DecodeError as e:
            self.counters["bad_messages"] += 1
            logger.warning("worker %s: bad message from %s: %s", self.worker_id, self.endpoints[conn], e)
            return
        with self._cv:
            if isinstance(body.get("incarnation"), str):  # the live trainer incarnation (asyncrl.pool.timeline)
                self.incarnation = body["incarnation"][:64]
            if kind == P.WELCOME:
                self._welcomed[conn] = True
                self.policy_version = max(self.policy_version, body["policy_version"])
            elif kind == P.LEASES:
                self.policy_version = max(self.policy_version, body["policy_version"])
                self._leases.extend(leases)
            elif kind == P.HEARTBEAT:
                self._pool_heartbeat = True
                pv = body.get("policy_version")
                if isinstance(pv, int):
                    self.policy_version = max(self.policy_version, pv)
            elif kind == P.CANCEL:
                # drop only leases of the abandoned timeline: ones the pool granted since its reset (it may
                # grant before its CANCEL leaves) stay valid, or they would be held until lease_timeout_s
                floor = body.get("min_lease_id")
                if not isinstance(floor, int) or isinstance(floor, bool):
                    floor = None  # a pool that names no floor: every queued lease of that connection
                void = {id(x) for x in self._leases if x.conn == conn and (floor is None or x.lease_id < floor)}
                self.counters["cancels_received"] += 1
                self.counters["leases_cancelled"] += len(void)
                self._leases = collections.deque(x for x in self._leases if id(x) not in void)
            elif kind == P.RESYNC:
                self._hello(d)
            elif kind == P.SHUTDOWN:
                if not self._shutdown[conn]:
                    # the acknowledgement the closing pool waits for: until it closes the connection, libzmq
                    # (IMMEDIATE=1) would drop what we have not read yet
                    self._send(d, P.BYE, {})
                self._shutdown[conn] = True
            self._cv.notify_all()

    def _leases_of(self, conn: int, body: dict[str, Any]) -> list[ReceivedLease]:
        out = []
        for item in body["leases"]:
            if not isinstance(item, dict):
                raise DecodeError("lease must be a map")
            ints = {}
            for key in ("lease_id", "epoch", "prompt_index", "group_size"):
                value = item.get(key)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise DecodeError(f"lease.{key} must be an int")
                ints[key] = value
            incarnation = body.get("incarnation")
            out.append(ReceivedLease(conn=conn, prompt=item.get("prompt"), policy_version=body["policy_version"],
                                     incarnation=incarnation[:64] if isinstance(incarnation, str) else "", **ints))
        return out
