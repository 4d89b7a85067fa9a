"""Collective backend of weight sync (``weights.type: nccl``): NCCL on GPUs, the same code over gloo on CPUs.

The broadcaster and its receivers form a process group of their own, constructed directly
(:func:`asyncrl.weights._collective.new_group`), never the trainer's default group; the control plane
(membership, group formation, which version goes to whom, rendezvous keys) is one ZeroMQ ROUTER of
the broadcaster's, bound like the rollout channel: loopback unless CURVE keys are given::

    receiver (control thread, DEALER)               broadcaster (I/O thread, ROUTER)
    HELLO {receiver_id} / BEAT {receiver_id, committed} ──► membership (a member unheard for peer_timeout_s is dropped)
    STORE {id, op, key, value}                     ──► rendezvous keys ◄── STORE_R {id, value}
                                                   ◄── FORM {generation, rank, world_size, backend, prefix, host}
                                                   ◄── JOB {generation, version, incarnation, mode, lora_config,
                                                            buckets, to}   (to: None = broadcast, else these ranks, p2p)
    STAGED / FAILED {generation, version, reason}  ──► who holds what
    COMMIT {receiver_id, version}                  ──► committed()
    BYE {receiver_id}                              ──► leaves: the group re-forms without it

Data plane: a JOB's buckets move bucket by bucket (``broadcast`` from rank 0 to everyone, or
``send``/``recv`` to the ranks named), each into a receiver's own bucket buffer; the receiver checks
every bucket's checksum (:func:`asyncrl.weights._collective.checksum`), then stages the version
(phase one); the worker applies it at a safe point and commits (phase two).

Generations: membership is fixed per group, so every change forms a new group (a new generation):
a receiver that joins later (or comes back) is added at the next formation and gets its first full
copy point-to-point in that group (``send``/``recv`` from rank 0; the members that hold the version are
not involved). A receiver that dies mid-transfer fails the collective at the broadcaster (gloo: at once,
``Connection reset by peer``; a hung one: after ``op_timeout_s``). The broadcaster then dissolves the
generation: it drops its group, which closes its connections, so every survivor's pending operation
fails at once (gloo; NCCL survivors abort their communicator on ABORT). Every member discards the
version in flight (none was staged: staging happens after the last bucket), counts the failure and
keeps its committed version. Members that speak again within ``peer_timeout_s`` of the abort form the
next generation; the dead one is dropped (``stats()["members_dropped"]``) and the version is sent again.
A bucket that fails its checksum fails only that receiver's version (counted, retried p2p after
``RETRY_S``); the group stays.

Who blocks on what: the trainer thread blocks in :meth:`NcclWeightBroadcaster.publish` while it copies
the tensors into the spare set of bucket buffers (double buffering: the set being sent is never
written). The broadcaster's I/O thread owns the socket and never blocks; its data thread forms groups
and moves buckets (blocking collectives). Each receiver has a control thread (socket, heartbeats) and a
data thread (formation, collectives, checksums); the worker's thread blocks only in :meth:`wait`.

Security: the rendezvous keys travel over the control socket (loopback, or CURVE with an allow-list),
under a random per-generation prefix, so only admitted receivers can join a group; a ``TCPStore`` is
not used (it listens on every interface). The bucket bytes themselves travel over gloo's/NCCL's own
sockets, which are not encrypted: across machines, use them on a trusted network.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import NoneType
from typing import Any
from urllib.parse import urlsplit

import torch
import zmq

from asyncrl._zmq.io import drain, is_loopback_bind
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.transport.protocol import check_fields
from asyncrl.weights import _collective as coll
from asyncrl.weights._checksum import fill_bucket
from asyncrl.weights._receiver import StagedReceiver
from asyncrl.weights._staging import check_receiver_id, plan_publish, unpack_bucket
from asyncrl.weights.base import (
    Bucket,
    WeightBroadcaster,
    WeightMode,
    WeightSyncError,
    WeightUpdate,
)
from asyncrl.weights.protocol import MODES, buckets_from_wire

__all__ = ["NcclWeightBroadcaster", "NcclWeightReceiver"]

logger = logging.getLogger(__name__)

TICK_S = 0.005
BEAT_S = 0.2
"""A receiver's control thread says BEAT this often (also while its data thread is blocked in a collective)."""
RETRY_S = 1.0
"""A receiver whose copy of a version failed its checksum is sent it again at the earliest this long after."""
MAX_MESSAGE_BYTES = 16 << 20
MAX_BUFFER_SETS = 3
"""Receiver bucket-buffer sets kept per layout: one being written, one staged, one being applied."""

HELLO, BEAT, STORE, STAGED, FAILED, COMMIT, BYE = "n_hello", "n_beat", "n_store", "n_staged", "n_failed", "n_commit", "n_bye"
FORM, JOB, STORE_R, ABORT = "n_form", "n_job", "n_store_r", "n_abort"
RECEIVER_KINDS = frozenset({HELLO, BEAT, STORE, STAGED, FAILED, COMMIT, BYE})
BROADCASTER_KINDS = frozenset({FORM, JOB, STORE_R, ABORT})
_OPT_INT = (int, NoneType)
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    HELLO: {"receiver_id": str},
    BEAT: {"receiver_id": str, "committed": _OPT_INT},
    STORE: {"id": int, "op": str, "key": str, "value": bytes},
    STAGED: {"generation": int, "version": int, "incarnation": str},
    FAILED: {"generation": int, "version": _OPT_INT, "reason": str},
    COMMIT: {"receiver_id": str, "version": int},
    BYE: {"receiver_id": str},
    FORM: {"generation": int, "rank": int, "world_size": int, "backend": str, "prefix": str, "host": str},
    JOB: {"generation": int, "version": int, "incarnation": str, "mode": str, "lora_config": (dict, NoneType),
          "buckets": list, "to": (list, NoneType)},
    STORE_R: {"id": int, "value": (bytes, NoneType)},
    ABORT: {"generation": int},
}


def _check(kind: str, body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    return check_fields(kind, body, allowed, _REQUIRED, "nccl weight message")


def check_rendezvous_bind(bind: str, curve_secret_key: str | None, allow_insecure_remote: bool) -> None:
    """Refuses a non-loopback control bind (hence rendezvous) without CURVE, as the rollout channel does.

    Raises:
        ValueError: naming the arguments that fix it.
    """
    if not is_loopback_bind(bind) and curve_secret_key is None and not allow_insecure_remote:
        raise ValueError(
            f"refusing to bind the nccl weight channel's rendezvous {bind!r} beyond loopback without "
            "authentication: pass curve_secret_key/curve_public_key and curve_allowed_keys (the workers' public "
            "keys; asyncrl.transport.zmq.generate_curve_keys), or allow_insecure_remote=True on a "
            "trusted network"
        )


def _host(bind: str) -> str:
    host = urlsplit(bind).hostname if bind.startswith("tcp://") else None
    return "127.0.0.1" if host in (None, "", "*", "0.0.0.0", "localhost") else host


@dataclass(slots=True)
class _Member:
    receiver_id: str
    identity: bytes
    last_heard: float
    committed: int | None = None
    has: tuple[int, str] | None = None
    """(version, incarnation) this receiver reported STAGED (or committed)."""
    sent: tuple[int, str] | None = None
    """(version, incarnation) moved to it in the current generation, not yet confirmed."""
    retry_after: float = 0.0


@dataclass(slots=True)
class _Version:
    version: int
    incarnation: str
    mode: WeightMode
    lora_config: dict[str, Any] | None
    buckets: list[Bucket]
    buffers: list[torch.Tensor]


@dataclass(slots=True)
class _Generation:
    number: int
    prefix: str
    members: list[str]
    """receiver ids; rank = position + 1 (the broadcaster is rank 0)."""
    pg: Any = None


def _stop_all(*events: threading.Event) -> None:
    for e in events:
        e.set()


class NcclWeightBroadcaster(WeightBroadcaster):
    """Trainer end: bucketed versions sent to a process group of the weight channel's own.

    Args:
        bind: the control endpoint (port 0 picks a free port; :attr:`address` is the real one). Its host
            is also where gloo's sockets bind.
        backend: ``gloo`` (CPU buckets; CI and CPU machines) or ``nccl`` (CUDA buckets). Default: ``nccl``
            when ``device`` is CUDA, else ``gloo``.
        device: where the bucket buffers live (``cpu``, or ``cuda``/``cuda:N`` for NCCL).
        bucket_bytes: the bucket size (a larger tensor gets its own bucket).
        op_timeout_s: the group's per-operation timeout (a hung member fails the operation after it).
        form_timeout_s: how long a group formation waits for every member to join.
        peer_timeout_s: a member unheard for this long is dropped from the next generation.
        curve_secret_key / curve_public_key / curve_allowed_keys: CURVE for a non-loopback ``bind``; only
            the allow-listed worker keys are admitted (``curve_allow_any_client`` admits any key).
        allow_insecure_remote: accept a non-loopback bind without CURVE (a trusted network only).
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        backend: str | None = None,
        device: str | torch.device = "cpu",
        bucket_bytes: int = 64 << 20,
        op_timeout_s: float = 60.0,
        form_timeout_s: float = 30.0,
        peer_timeout_s: float = 3.0,
        curve_secret_key: str | None = None,
        curve_public_key: str | None = None,
        curve_allowed_keys: list[str] | tuple[str, ...] = (),
        curve_allow_any_client: bool = False,
        allow_insecure_remote: bool = False,
    ):
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend not in ("gloo", "nccl") or (self.backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(f"backend={self.backend!r} with device={self.device}: use gloo with cpu, nccl with cuda")
        if bucket_bytes <= 0 or min(op_timeout_s, form_timeout_s, peer_timeout_s) <= 0:
            raise ValueError(f"{bucket_bytes=}, {op_timeout_s=}, {form_timeout_s=}, {peer_timeout_s=} must be > 0")
        check_rendezvous_bind(bind, curve_secret_key, allow_insecure_remote)
        if curve_secret_key is not None and not curve_allowed_keys and not curve_allow_any_client:
            raise ValueError("a CURVE nccl weight channel needs curve_allowed_keys (the workers' public keys) "
                             "or curve_allow_any_client=True")
        WeightBroadcaster.__init__(self)
        self.bind, self.host = bind, _host(bind)
        self.bucket_bytes = bucket_bytes
        self.op_timeout_s, self.form_timeout_s, self.peer_timeout_s = op_timeout_s, form_timeout_s, peer_timeout_s
        self._curve = (curve_secret_key, curve_public_key, frozenset(curve_allowed_keys))
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._keys = coll.KeyTable()
        self._members: dict[str, _Member] = {}
        self._identities: dict[bytes, str] = {}
        self._committed: dict[str, int] = {}
        self._outbox: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._newest: _Version | None = None
        self._sets: list[list[torch.Tensor]] = []
        self._sending: list[torch.Tensor] | None = None
        self._gen: _Generation | None = None
        self._generations = itertools.count(1)
        self._dissolved_at: float | None = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._recent_errors: collections.deque[str] = collections.deque(maxlen=16)
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._endpoint: str | None = None
        self._finalizer = weakref.finalize(self, _stop_all, self._stop, self._kick)
        self._io = threading.Thread(target=self._run_io, name="asyncrl-nccl-broadcaster-io", daemon=True)
        self._data = threading.Thread(target=self._run_data, name="asyncrl-nccl-broadcaster-data", daemon=True)
        self._io.start()
        if not self._ready.wait(30) or self._endpoint is None:
            self.close()
            raise WeightSyncError(f"nccl weight broadcaster could not bind {bind!r}") from self._error
        self._data.start()

    # -- trainer thread ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint

    def _publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, mode: WeightMode,
                 lora_config: dict[str, Any] | None, incarnation: str,
                 plan: Sequence[Bucket] | None = None) -> dict[str, Any]:
        if plan is not None:
            raise ValueError("the nccl backend packs versions its own way and cannot re-serve a bucket plan; "
                             "publish without plan=")
        t0 = time.perf_counter()
        buckets = plan_publish(tensors, version, self._last_version, mode, lora_config, self.bucket_bytes)
        buffers = self._spare_set(buckets)
        for b, buf in zip(buckets, buffers):
            if buf.is_cuda:
                coll.fill_device_bucket(b, tensors, buf)
                b.checksum = coll.checksum(buf)
            else:
                b.checksum = fill_bucket(b, tensors, buf)  # the copy fused with the checksum
        t1 = time.perf_counter()
        entry = _Version(version, incarnation, mode, lora_config, buckets, buffers)
        encode(JOB, {"lora_config": lora_config})  # TypeError now, not in the I/O thread
        with self._lock:
            self._newest = entry
            self._last_version = version
            self._counters["versions_published"] += 1
        self._kick.set()
        return {"bytes": sum(b.nbytes for b in buckets), "buckets": len(buckets), "snapshot_s": t1 - t0,
                "checksum_s": time.perf_counter() - t1}

    def _spare_set(self, buckets: list[Bucket]) -> list[torch.Tensor]:
        """Bucket buffers for the next version: a set not being sent (made once per layout, then reused)."""
        sizes = [b.nbytes for b in buckets]
        with self._lock:
            sending = self._sending
            self._sets = [s for s in self._sets if [t.numel() for t in s] == sizes]
            for s in self._sets:
                if s is not sending:
                    return s
            new = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self._sets.append(new)
            return new

    def committed(self) -> dict[str, int]:
        with self._lock:
            return dict(self._committed)

    def members(self) -> list[str]:
        """The receiver ids of the current generation, in rank order (rank 1 first)."""
        with self._lock:
            return list(self._gen.members) if self._gen is not None else []

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"generations": 0, "generation_aborts": 0, "form_failures": 0,
                                   "members_dropped": 0, "bad_messages": 0, "bytes_sent": 0, "receiver_failures": 0}
            out.update(self._counters)
            out["generation"] = self._gen.number if self._gen else None
            out["members"] = list(self._gen.members) if self._gen else []
            out["receivers"] = sorted(self._members)
            out["recent_errors"] = list(self._recent_errors)
        return out

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        for t in (self._data, self._io):
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=10)
        if not self._io.is_alive():
            self._ctx.term()
        self._gen = None
        self._finalizer()

    # -- I/O thread: the socket, membership, rendezvous keys -------------------------------------
    def _run_io(self) -> None:
        secret, public, allowed = self._curve
        auth = None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            if secret is not None:
                from asyncrl._zmq.curve import start_authenticator

                auth = start_authenticator(self._ctx, allowed, lambda name: self._count(name))
                sock.curve_secretkey, sock.curve_publickey = secret.encode(), (public or "").encode()
                sock.curve_server = True
            sock.bind(self.bind)
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # reported to __init__ in the caller's thread
            self._error = e
            sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(int(TICK_S * 1000)):
                    drain(sock, lambda frames: self._handle(frames), 64)
                while self._outbox:
                    identity, frames = self._outbox.popleft()
                    self._send(sock, identity, frames)
        except BaseException as e:  # thread boundary: publish() re-raises it
            logger.exception("nccl weight broadcaster I/O thread died")
            self._error = e
        finally:
            sock.close(linger=0)
            if auth is not None:
                auth.stop()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[Any]) -> None:
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # a receiver gone: its heartbeat stops and the next formation drops it
            self._count("send_failed")

    def _post(self, receiver_id: str, kind: str, body: dict[str, Any]) -> None:
        with self._lock:
            m = self._members.get(receiver_id)
        if m is not None:
            self._outbox.append((m.identity, encode(kind, body)))

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            kind, body = decode(frames[1:], max_message_bytes=MAX_MESSAGE_BYTES)
            _check(kind, body, RECEIVER_KINDS)
            rid = body.get("receiver_id")
            if rid is not None:
                check_receiver_id(rid)
        except (DecodeError, ValueError) as e:  # bad input from a peer: counted and dropped
            self._count("bad_messages")
            self._recent_errors.append(f"{identity.hex()}: {str(e)[:200]}")
            return
        now = time.monotonic()
        with self._lock:
            if kind in (HELLO, BEAT, COMMIT):
                m = self._members.get(rid)
                if m is None or m.identity != identity:  # new, or back under a new connection
                    m = self._members[rid] = _Member(rid, identity, now)
                    self._identities[identity] = rid
                    self._kick.set()
                m.last_heard = now
                committed = body.get("committed") if kind == BEAT else body.get("version")
                if committed is not None and committed > self._committed.get(rid, -(2**63)):
                    self._committed[rid] = committed
                return
            rid = self._identities.get(identity)
            m = self._members.get(rid) if rid is not None else None
            if m is None or m.identity != identity:
                self._counters["bad_messages"] += 1  # STORE/STAGED/FAILED/BYE from a peer that never said HELLO
                return
            m.last_heard = now
            if kind == BYE:
                del self._members[rid]
                self._kick.set()
            elif kind == STAGED:
                m.has = (body["version"], body["incarnation"])
                self._kick.set()
            elif kind == FAILED:
                m.sent, m.retry_after = None, now + RETRY_S
                self._counters["receiver_failures"] += 1
                self._recent_errors.append(f"{rid}: {body['reason'][:200]}")
                self._kick.set()
        if kind == STORE:
            self._store(identity, body)

    def _store(self, identity: bytes, body: dict[str, Any]) -> None:
        if body["op"] == "set":
            self._keys.set(body["key"], body["value"])
            value = b""
        else:
            value = self._keys.get(body["key"])
        self._outbox.append((identity, encode(STORE_R, {"id": body["id"], "value": value})))

    def _local_store(self, op: str, key: str, value: bytes) -> bytes | None:
        if self._stop.is_set():
            raise WeightSyncError("nccl weight broadcaster is closing")
        if op == "set":
            self._keys.set(key, value)
            return b""
        return self._keys.get(key)

    # -- data thread: generations and jobs -------------------------------------------------------
    def _run_data(self) -> None:
        try:
            while not self._stop.is_set():
                self._kick.wait(0.05)
                self._kick.clear()
                self._step()
        except BaseException as e:  # thread boundary: publish() re-raises it
            logger.exception("nccl weight broadcaster data thread died")
            self._error = e
        finally:
            self._dissolve("closing", notify=False)

    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid, m in list(self._members.items()):
                if now - m.last_heard > self.peer_timeout_s:
                    del self._members[rid]
                    self._counters["members_dropped"] += 1
                    logger.warning("nccl weights: receiver %s unheard for %.1f s; dropped", rid, now - m.last_heard)
            live = sorted(self._members)
            if self._dissolved_at is not None:  # after an abort, only members heard since then
                heard = [r for r in live if self._members[r].last_heard > self._dissolved_at]
                if len(heard) < len(live) and now - self._dissolved_at < self.peer_timeout_s:
                    return  # give the survivors a beat to speak
                live = heard
            gen = self._gen
        if gen is not None and gen.members != live:
            self._dissolve(f"membership changed: {gen.members} -> {live}", notify=True, clean=True)
        if self._gen is None and live:
            self._form(live)
        if self._gen is not None:
            self._serve()

    def _form(self, members: list[str]) -> None:
        number = next(self._generations)
        prefix = f"asyncrl-weights/{number}/{secrets.token_hex(16)}/"
        gen = _Generation(number, prefix, members)
        for rank, rid in enumerate(members, 1):
            with self._lock:
                m = self._members.get(rid)
                if m is not None:
                    m.sent = None
            self._post(rid, FORM, {"generation": number, "rank": rank, "world_size": len(members) + 1,
                                   "backend": self.backend, "prefix": prefix, "host": self.host})
        try:
            store = coll.RendezvousStore(prefix, self._local_store, self.form_timeout_s)
            gen.pg = coll.new_group(self.backend, store, 0, len(members) + 1, host=self.host, timeout_s=self.op_timeout_s)
        except Exception as e:  # a member did not join: count it, let the survivors speak, form again
            self._keys.drop_prefix(prefix)
            with self._lock:
                self._counters["form_failures"] += 1
                self._recent_errors.append(f"generation {number} formation failed: {str(e)[:200]}")
                self._dissolved_at = time.monotonic()
            for rid in members:
                self._post(rid, ABORT, {"generation": number})
            logger.warning("nccl weights: generation %d (%s) did not form: %s", number, members, e)
            return
        with self._lock:
            self._gen, self._dissolved_at = gen, None
            self._counters["generations"] += 1
        logger.info("nccl weights: generation %d formed with %s (%s)", number, members, self.backend)

    def _dissolve(self, reason: str, *, notify: bool, clean: bool = False) -> None:
        """Drops the group (its connections close, so members' pending operations fail) and says ABORT."""
        with self._lock:
            gen, self._gen = self._gen, None
            if gen is not None and not clean:
                self._dissolved_at = time.monotonic()
        if gen is None:
            return
        pg, gen.pg = gen.pg, None
        if pg is not None and self.backend == "nccl":
            pg.abort()
        del pg
        self._keys.drop_prefix(gen.prefix)
        if notify:
            for rid in gen.members:
                self._post(rid, ABORT, {"generation": gen.number})
        logger.info("nccl weights: generation %d dissolved (%s)", gen.number, reason)

    def _serve(self) -> None:
        gen = self._gen
        now = time.monotonic()
        with self._lock:
            entry = self._newest
            if entry is None or gen is None:
                return
            want = (entry.version, entry.incarnation)
            members = [self._members.get(r) for r in gen.members]
            lacking = [rank for rank, m in enumerate(members, 1)
                       if m is not None and m.has != want and m.sent != want and now >= m.retry_after]
            if not lacking:
                return
            self._sending = entry.buffers
        error = None
        try:
            if len(lacking) == len(gen.members):
                self._job(gen, entry, None)
            else:
                for rank in lacking:
                    self._job(gen, entry, [rank])
        except Exception as e:  # a member died or hung mid-transfer: the generation ends, survivors re-form
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._sending = None
        if error is not None:  # out of the except block: its traceback held the group (and its connections) open
            with self._lock:
                self._counters["generation_aborts"] += 1
                self._recent_errors.append(f"generation {gen.number}, version {entry.version}: {error[:200]}")
            logger.warning("nccl weights: version %d failed in generation %d (%s); re-forming",
                           entry.version, gen.number, error)
            self._dissolve(f"transfer failed: {error}", notify=True)

    def _job(self, gen: _Generation, entry: _Version, to: list[int] | None) -> None:
        body = {"generation": gen.number, "version": entry.version, "incarnation": entry.incarnation,
                "mode": entry.mode, "lora_config": entry.lora_config,
                "buckets": [b.to_wire() for b in entry.buckets], "to": to}
        targets = gen.members if to is None else [gen.members[r - 1] for r in to]
        for rid in targets:
            self._post(rid, JOB, body)
        for buf in entry.buffers:
            if to is None:
                coll.broadcast(gen.pg, buf, 0)
            else:
                for rank in to:
                    coll.send(gen.pg, buf, rank)
        with self._lock:
            for rid in targets:
                if (m := self._members.get(rid)) is not None:
                    m.sent = (entry.version, entry.incarnation)
            nbytes = sum(b.nbytes for b in entry.buckets)
            self._counters["bytes_sent"] += nbytes * (len(targets) if to is not None else 1)
            self._counters["jobs_broadcast" if to is None else "jobs_p2p"] += 1


@dataclass(slots=True)
class _BufferSet:
    buffers: list[torch.Tensor]
    held: bool = False
    """Under a staged or handed-out update (released by :class:`~asyncrl.weights._staging.StagingArea`)."""


@dataclass(slots=True)
class _Group:
    generation: int
    rank: int
    pg: Any


class NcclWeightReceiver(StagedReceiver):
    """Worker end: a member of the broadcaster's process group, re-formed on every membership change.

    Args:
        address: the broadcaster's :attr:`~NcclWeightBroadcaster.address` (its control endpoint).
        receiver_id: unique name of this worker (``committed()`` is keyed by it).
        device: where the bucket buffers live (``cpu`` for gloo; for nccl, default ``cuda`` current device).
        timeout_s: how long :meth:`start` waits to be admitted to a generation (its first FORM).
        form_timeout_s / op_timeout_s: as the broadcaster's (rendezvous wait; per-operation timeout).
        curve_server_key / curve_secret_key: the broadcaster's CURVE public key and this worker's secret
            key, for a broadcaster bound beyond loopback.

    An update's tensors are views into this receiver's bucket buffers, valid until a newer version is committed (the
    engine copies them into its own parameters when it applies them). What the worker's thread calls (``poll``,
    ``wait``, ``commit``, ``stats``, ``close``) is :class:`~asyncrl.weights._receiver.StagedReceiver`'s; its I/O thread
    is the control thread (the socket), which starts a data thread (formation, collectives, checksums) of its own.
    """

    uses_zmq = True

    def __init__(
        self,
        address: str,
        *,
        receiver_id: str,
        device: str | torch.device | None = None,
        timeout_s: float = 30.0,
        form_timeout_s: float = 30.0,
        op_timeout_s: float = 60.0,
        curve_server_key: str | None = None,
        curve_secret_key: str | None = None,
    ):
        StagedReceiver.__init__(self, address, receiver_id=receiver_id)
        self.device = None if device is None else torch.device(device)
        self.timeout_s, self.form_timeout_s, self.op_timeout_s = timeout_s, form_timeout_s, op_timeout_s
        self._curve = (curve_server_key, curve_secret_key)
        self._admitted = threading.Event()
        self._inbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._outbox: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._store_ids = itertools.count(1)
        self._store_replies: dict[int, Any] = {}
        self._store_cv = threading.Condition()
        self._group: _Group | None = None
        self._latest_form = 0
        self._aborted = 0
        """The newest generation a FORM named / the newest one an ABORT ended (control thread writes)."""
        self._sets: list[_BufferSet] = []
        self._sets_lock = threading.Lock()
        self._data = threading.Thread(target=self._run_data, name=f"asyncrl-nccl-data-{self.receiver_id}", daemon=True)

    # -- StagedReceiver's hooks (worker thread) ----------------------------------------------------
    def _wait_started(self) -> None:
        """Says HELLO (the control thread) and waits to be admitted to a generation.

        Raises:
            WeightSyncError: if no FORM came within ``timeout_s``.
        """
        if not self._admitted.wait(self.timeout_s):
            self.close()
            raise WeightSyncError(
                f"receiver {self.receiver_id}: not admitted to a weight group by the broadcaster at {self.address!r} "
                f"within timeout_s={self.timeout_s}; check the address, the CURVE keys and that the trainer is running"
            )

    def _on_commit(self, version: int) -> None:
        self._outbox.append((COMMIT, {"receiver_id": self.receiver_id, "version": version}))

    def stats(self) -> dict[str, Any]:
        out = StagedReceiver.stats(self)
        group = self._group
        out.update(generation=group.generation if group else None, rank=group.rank if group else None)
        return out

    def close(self) -> None:
        self._outbox.append((BYE, {"receiver_id": self.receiver_id}))
        self._io.close(before_join=self._wake_data)
        if self._data.ident is not None and self._data is not threading.current_thread():
            self._data.join(timeout=10)
        self._staging.close()

    def _wake_data(self) -> None:
        self._inbox.put(("", {}))
        with self._store_cv:
            self._store_cv.notify_all()  # a formation waiting on a rendezvous reply gives up

    # -- control thread: the socket ----------------------------------------------------------------
    def _loop(self) -> None:
        self._data.start()
        server_key, secret = self._curve
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if server_key is not None:
            public, own = (zmq.curve_public(secret.encode()), secret.encode()) if secret else zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key.encode(), public, own
        sock.connect(self.address)
        next_beat = 0.0
        try:
            self._send(sock, HELLO, {"receiver_id": self.receiver_id})
            while not self._stop.is_set():
                if sock.poll(int(TICK_S * 1000)):
                    drain(sock, self._handle, 64)
                while self._outbox:
                    self._send(sock, *self._outbox.popleft())
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + BEAT_S
                    self._send(sock, BEAT, {"receiver_id": self.receiver_id,
                                            "committed": self._staging.committed_version})
        finally:
            while self._outbox:  # a COMMIT or BYE made just before close() still goes out
                self._send(sock, *self._outbox.popleft())
            sock.close(linger=500)

    def _send(self, sock: zmq.Socket, kind: str, body: dict[str, Any]) -> None:
        try:
            sock.send_multipart(encode(kind, body), zmq.NOBLOCK)
        except zmq.Again:
            self._staging.count(f"send_dropped_{kind}")

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            kind, body = decode(frames, max_message_bytes=MAX_MESSAGE_BYTES)
            _check(kind, body, BROADCASTER_KINDS)
        except DecodeError as e:
            self._staging.count("bad_messages")
            logger.warning("receiver %s: bad message from the nccl weight broadcaster: %s", self.receiver_id, e)
            return
        self._staging.set_info(last_heard=time.time())
        if kind == STORE_R:
            with self._store_cv:
                self._store_replies[body["id"]] = body["value"]
                self._store_cv.notify_all()
            return
        if kind == FORM:
            self._latest_form = max(self._latest_form, body["generation"])
        elif kind == ABORT:
            self._aborted = max(self._aborted, body["generation"])
        group = self._group
        if (kind == ABORT and group is not None and group.generation == body["generation"]
                and isinstance(group.pg, getattr(torch.distributed, "ProcessGroupNCCL", ()))):
            group.pg.abort()  # unblocks a pending NCCL collective; gloo's fail when the broadcaster's group closes
        self._inbox.put((kind, body))

    def _store_request(self, generation: int, op: str, key: str, value: bytes) -> bytes | None:
        """A rendezvous-store round trip through the control thread (called from the data thread).

        Raises:
            WeightSyncError: when ``generation`` is over (a newer FORM or its ABORT came): a formation that
                cannot complete gives up at once instead of waiting ``form_timeout_s`` behind newer ones.
        """
        if self._latest_form > generation or self._aborted >= generation:
            raise WeightSyncError(f"receiver {self.receiver_id}: generation {generation} is over")
        rid = next(self._store_ids)
        self._outbox.append((STORE, {"id": rid, "op": op, "key": key, "value": value}))
        deadline = time.monotonic() + self.form_timeout_s
        with self._store_cv:
            while rid not in self._store_replies:
                if self._stop.is_set() or not self._store_cv.wait(max(0.0, deadline - time.monotonic())):
                    raise WeightSyncError(f"receiver {self.receiver_id}: no rendezvous reply within "
                                          f"form_timeout_s={self.form_timeout_s}")
            return self._store_replies.pop(rid)

    # -- data thread: formation, collectives, checksums -----------------------------------------
    def _run_data(self) -> None:
        try:
            while not self._stop.is_set():
                kind, body = self._inbox.get()
                if kind == FORM:
                    self._form(body)
                elif kind == JOB:
                    self._job(body)
                elif kind == ABORT and self._group is not None and self._group.generation == body["generation"]:
                    self._group = None
        except BaseException as e:  # thread boundary: poll()/wait() re-raise it
            logger.exception("receiver %s: nccl weight data thread died", self.receiver_id)
            self._staging.die(e)
        finally:
            self._group = None

    def _form(self, body: dict[str, Any]) -> None:
        self._group = None  # the previous generation's group is over
        generation = body["generation"]
        if self._latest_form > generation or self._aborted >= generation:
            self._staging.count("stale_forms")  # a newer FORM (or this one's ABORT) is already here
            return
        backend = body["backend"]
        if backend not in ("gloo", "nccl") or not 1 <= body["rank"] < body["world_size"]:
            self._staging.count("bad_messages")
            return
        if backend == "nccl":
            if self.device is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        elif self.device is None:
            self.device = torch.device("cpu")
        try:
            request = functools.partial(self._store_request, generation)
            store = coll.RendezvousStore(body["prefix"], request, self.form_timeout_s)
            pg = coll.new_group(backend, store, body["rank"], body["world_size"], host=body["host"],
                                timeout_s=self.op_timeout_s)
        except Exception as e:  # the broadcaster forms again; nothing staged is affected
            self._fail_generation(body["generation"], None, f"generation {body['generation']} did not form: {e}")
            return
        self._group = _Group(body["generation"], body["rank"], pg)
        self._staging.count("generations_joined")
        self._admitted.set()

    def _free_set(self, sizes: list[int]) -> _BufferSet:
        """Bucket buffers no staged or handed-out update views (made once per layout, then reused)."""
        with self._sets_lock:
            self._sets = [s for s in self._sets if [b.numel() for b in s.buffers] == sizes]
            for s in self._sets:
                if not s.held:
                    return s
            new = _BufferSet([torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes])
            if len(self._sets) < MAX_BUFFER_SETS:
                self._sets.append(new)
            else:
                self._staging.count("extra_buffer_sets")  # every set is held (staged, applying): not kept
            return new

    def _release(self, target: _BufferSet) -> None:
        with self._sets_lock:
            target.held = False

    def _job(self, body: dict[str, Any]) -> None:
        group = self._group
        if group is None or body["generation"] != group.generation:
            self._staging.count("stale_jobs")  # of a generation that is over
            return
        if body["to"] is not None and group.rank not in body["to"]:
            return  # a point-to-point job for another member
        version, incarnation = body["version"], body["incarnation"]
        t0 = time.monotonic()
        try:
            if body["mode"] not in MODES or len(incarnation) > 64:
                raise DecodeError(f"job mode {body['mode']!r:.20} / incarnation invalid")
            buckets = buckets_from_wire(body["buckets"])
        except DecodeError as e:  # cannot take part safely: leave the group; the broadcaster re-forms
            self._staging.count("bad_messages")
            self._group = None
            self._fail_generation(group.generation, version, f"malformed job: {e}")
            return
        target = self._free_set([b.nbytes for b in buckets])
        bad: list[str] = []
        try:
            for b, buf in zip(buckets, target.buffers):
                if body["to"] is None:
                    coll.broadcast(group.pg, buf, 0)
                else:
                    coll.recv(group.pg, buf, 0)
                got = coll.checksum(buf)
                if got != b.checksum:  # keep receiving: the collective goes on in lockstep
                    bad.append(f"bucket {b.index}: checksum {got:#x}, the broadcaster says {b.checksum:#x}")
                self._staging.count("bytes_received", b.nbytes)
        except Exception as e:  # a member died or the broadcaster dissolved the generation
            self._group = None
            self._fail_generation(group.generation, version, f"transfer of version {version} failed in generation "
                                                  f"{group.generation}: {e}")
            return
        if bad:
            self._fail_generation(group.generation, version, f"version {version}: {'; '.join(bad)[:400]}")
            return
        if not self._staging.is_newer(version, incarnation):
            self._outbox.append((STAGED, {"generation": group.generation, "version": version, "incarnation": incarnation}))
            return  # already staged or committed (sent again after a re-form)
        tensors: dict[str, torch.Tensor] = {}
        for b, buf in zip(buckets, target.buffers):
            tensors.update(unpack_bucket(b, buf))
        with self._sets_lock:
            target.held = True
        meta = {"receiver_id": self.receiver_id, "buckets": len(buckets), "generation": group.generation,
                "transfer_s": time.monotonic() - t0}
        self._staging.stage(WeightUpdate(version=version, mode=body["mode"], tensors=tensors,
                                         lora_config=body["lora_config"], metadata=meta, incarnation=incarnation),
                            release=lambda: self._release(target))
        self._outbox.append((STAGED, {"generation": group.generation, "version": version, "incarnation": incarnation}))

    def _fail_generation(self, generation: int, version: int | None, reason: str) -> None:
        """Counts and logs a failed formation or transfer, and tells the broadcaster (it re-forms or sends again)."""
        self._staging.fail(version, reason)
        self._outbox.append((FAILED, {"generation": generation, "version": version, "reason": reason[:500]}))
        logger.warning("receiver %s: %s; keeping committed version %s", self.receiver_id, reason,
                       self._staging.committed_version)
