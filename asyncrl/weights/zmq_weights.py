"""ZeroMQ backend of weight sync: both ends of its wire protocol (bucketed, two-phase, pull-the-latest).

Topology: the trainer's :class:`ZmqWeightBroadcaster` binds one ROUTER; each worker's
:class:`ZmqWeightReceiver` connects one DEALER. Every message is an :mod:`asyncrl.codec` message; a
bucket's bytes travel as a uint8 tensor, i.e. as their own zero-copy frame::

    receiver                                 broadcaster
    WANT {receiver_id, have, committed}  ──► MANIFEST {version, mode, lora_config, nbytes, buckets} | NONE
    GET {version, index}  (≤ window)     ──► BUCKET {version, index, data} | GONE {version, index}
    COMMIT {receiver_id, version}        ──► (recorded; committed() reports it)
                                         ◄── ANNOUNCE {version}  (on publish, to every receiver seen)

Who blocks on what:

* Broadcaster: the trainer thread blocks in :meth:`ZmqWeightBroadcaster.publish` only while it
  snapshots the tensors into bucket buffers and checksums them; it never touches the socket. One I/O
  thread owns the ROUTER, polls with a short timeout (``TICK_S``), answers requests from the newest
  ``keep_versions`` snapshots (immutable once published) and announces new versions.
* Receiver: one I/O thread owns the DEALER. It asks WANT on start, on ANNOUNCE and every
  ``WANT_INTERVAL_S`` as a fallback, fetches the newest version with at most ``window`` GETs in flight
  (bounded memory), copies every bucket out of its frame into a private buffer, verifies size and
  crc32 there, and stages the update once all buckets are verified. The worker's thread blocks only
  in :meth:`ZmqWeightReceiver.wait` (with a timeout); ``poll`` and ``commit`` never block.

A failed transfer (checksum or size mismatch, GONE, no progress for ``timeout_s``, a malformed
message) is discarded whole, counted in ``stats()["failures"]`` with its reason, logged, and retried
after ``RETRY_S``; the committed version stays in effect. A newer MANIFEST mid-transfer abandons the
older transfer (counted in ``stats()["abandoned"]``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import NoneType
from typing import Any

import torch
import zmq

from asyncrl.codec import DecodeError, decode, encode
from asyncrl.transport._zmq_util import drain
from asyncrl.transport.protocol import check_fields
from asyncrl.weights._staging import (
    MODES,
    StagingArea,
    buckets_from_wire,
    check_publish,
    check_receiver_id,
    fill_bucket,
    unpack_bucket,
)
from asyncrl.weights.base import (
    Bucket,
    WeightBroadcaster,
    WeightMode,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
    bucket_checksum,
    plan_buckets,
)

__all__ = ["ZmqWeightBroadcaster", "ZmqWeightReceiver"]

logger = logging.getLogger(__name__)

TICK_S = 0.005
MAX_DRAIN = 64
WANT_INTERVAL_S = 1.0
"""Fallback poll: a receiver asks for the newest version this often even without an ANNOUNCE."""
RETRY_S = 1.0
"""A failed version is fetched again at the earliest this long after the failure."""
MAX_REQUEST_BYTES = 1 << 20
CONTROL_MAX_BYTES = 64 << 20
"""Largest manifest a receiver accepts; bucket messages may be as large as the largest bucket seen + 1 MiB."""
SNDHWM = 1000
COMMIT_LINGER_MS = 1000
"""How long close() lets a just-sent COMMIT reach the broadcaster."""

WANT, GET, COMMIT = "w_want", "w_get", "w_commit"
MANIFEST, NONE, BUCKET, GONE, ANNOUNCE = "w_manifest", "w_none", "w_bucket", "w_gone", "w_announce"
RECEIVER_KINDS = frozenset({WANT, GET, COMMIT})
BROADCASTER_KINDS = frozenset({MANIFEST, NONE, BUCKET, GONE, ANNOUNCE})
_OPT_INT = (int, NoneType)
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    WANT: {"receiver_id": str, "have": _OPT_INT, "committed": _OPT_INT},  # + optional "have_incarnation": str
    GET: {"version": int, "index": int},
    COMMIT: {"receiver_id": str, "version": int},
    MANIFEST: {"version": int, "mode": str, "lora_config": (dict, NoneType), "nbytes": int, "buckets": list},
    NONE: {},
    BUCKET: {"version": int, "index": int, "data": torch.Tensor},
    GONE: {"version": int, "index": int},
    ANNOUNCE: {"version": int},
}


def _check(kind: str, body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """Checks kind and body fields of a peer's message; raises DecodeError naming the field."""
    return check_fields(kind, body, allowed, _REQUIRED, "weight message")


def _stop_thread(stop: threading.Event) -> None:
    stop.set()


@dataclass(slots=True)
class _Version:
    version: int
    buckets: list[Bucket]
    buffers: list[torch.Tensor]
    manifest: list[Any]
    """The encoded MANIFEST frames, sent as is to every WANT."""
    corrupt: dict[int, torch.Tensor] = field(default_factory=dict)
    """Fault injection: bucket index -> the corrupted copy served instead."""
    incarnation: str = ""
    """The trainer incarnation that published it."""


class ZmqWeightBroadcaster(WeightBroadcaster):
    """Trainer end: snapshots versions into buckets and serves them from a ROUTER's I/O thread.

    Args:
        bind: ZeroMQ endpoint to bind (port 0 picks a free port; :attr:`address` is the real one).
        bucket_bytes: the bucket size (a larger tensor gets its own bucket).
        keep_versions: snapshots kept for receivers still fetching (the newest is always kept).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, bucket_bytes: int = 64 << 20, keep_versions: int = 2):
        if bucket_bytes <= 0 or keep_versions < 1:
            raise ValueError(f"{bucket_bytes=} must be > 0 and {keep_versions=} >= 1")
        self.bind = bind
        self.bucket_bytes = bucket_bytes
        self.keep_versions = keep_versions
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._versions: collections.deque[_Version] = collections.deque()
        self._last_version: int | None = None
        self._announce: int | None = None
        self._wake_addr = f"inproc://asyncrl-weights-wake-{id(self):x}"
        self._waker: zmq.Socket | None = None  # trainer side of the wake-up pipe, used under _publish_lock
        self._corrupt_next: int | None = None
        self._committed: dict[str, int] = {}
        self._peers: dict[bytes, str] = {}
        self._counters: collections.Counter[str] = collections.Counter()
        self._recent_errors: collections.deque[tuple[str, str]] = collections.deque(maxlen=32)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._endpoint: str | None = None
        self._error: BaseException | None = None
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop)
        self._thread = threading.Thread(target=self._run, name="asyncrl-weight-broadcaster", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._endpoint is None:
            self.close()
            raise WeightSyncError(f"weight broadcaster could not bind {bind!r}") from self._error

    # -- trainer thread ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: WeightMode = "full",
        lora_config: dict[str, Any] | None = None,
        incarnation: str = "",
    ) -> dict[str, Any]:
        if self._error is not None:
            raise WeightSyncError(f"weight broadcaster I/O thread died: {self._error!r}") from self._error
        with self._publish_lock:
            check_publish(tensors, version, self._last_version, mode, lora_config)
            t0 = time.perf_counter()
            buckets = plan_buckets(tensors, self.bucket_bytes)
            buffers = []
            for b in buckets:
                buffers.append(torch.empty(b.nbytes, dtype=torch.uint8))
                fill_bucket(b, tensors, buffers[-1])
            t1 = time.perf_counter()
            for b, buf in zip(buckets, buffers):
                b.checksum = bucket_checksum(memoryview(buf.numpy()))
            t2 = time.perf_counter()
            nbytes = sum(b.nbytes for b in buckets)
            manifest = {"version": version, "incarnation": incarnation, "mode": mode, "lora_config": lora_config,
                        "nbytes": nbytes,
                        "buckets": [b.to_wire() for b in buckets]}
            entry = _Version(version, buckets, buffers, encode(MANIFEST, manifest))  # TypeError: lora_config
            entry.incarnation = incarnation
            entry.corrupt = self._take_corruption(entry)
            with self._lock:
                self._versions.append(entry)
                while len(self._versions) > self.keep_versions:
                    self._versions.popleft()
                self._last_version = version
                self._announce = version
                self._counters["versions_published"] += 1
            self._wake()
        return {"version": version, "bytes": nbytes, "buckets": len(buckets),
                "snapshot_s": t1 - t0, "checksum_s": t2 - t1, "publish_s": time.perf_counter() - t0}

    def _wake(self) -> None:
        """Wakes the I/O thread so the ANNOUNCE goes out now, not on its next tick."""
        if self._waker is None:
            self._waker = self._ctx.socket(zmq.PUSH)
            self._waker.setsockopt(zmq.LINGER, 0)
            self._waker.connect(self._wake_addr)
        try:
            self._waker.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # a wake-up is already pending
            pass

    def corrupt_next(self, bucket_index: int) -> None:
        """Fault injection for tests: the next published version serves ``bucket_index`` corrupted.

        One byte of the served copy is flipped for every GET of that bucket of that version (so
        retries fail too); the manifest keeps the true checksum. The version after it is clean.
        """
        with self._lock:
            self._corrupt_next = bucket_index

    def _take_corruption(self, entry: _Version) -> dict[int, torch.Tensor]:
        with self._lock:
            index, self._corrupt_next = self._corrupt_next, None
        if index is None:
            return {}
        if not 0 <= index < len(entry.buckets) or entry.buckets[index].nbytes == 0:
            raise ValueError(f"corrupt_next({index}): version {entry.version} has {len(entry.buckets)} buckets "
                             f"and that one must hold bytes")
        bad = entry.buffers[index].clone()
        bad[bad.numel() // 2] ^= 0xFF
        return {index: bad}

    def committed(self) -> dict[str, int]:
        with self._lock:
            return dict(self._committed)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"requests": 0, "bytes_served": 0, "bad_messages": 0}
            out.update(self._counters)
            out["versions"] = [v.version for v in self._versions]
            out["receivers"] = sorted(set(self._peers.values()))
            out["recent_errors"] = list(self._recent_errors)
        return out

    def close(self) -> None:
        self._stop.set()
        with self._publish_lock:
            if self._waker is not None:
                self._waker.close(linger=0)
                self._waker = None
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._ctx.term()  # the I/O thread closed its socket
        with self._lock:
            self._versions.clear()
        self._finalizer()

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone receiver raises instead of vanishing silently
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        wake = self._ctx.socket(zmq.PULL)
        wake.setsockopt(zmq.LINGER, 0)
        try:
            wake.bind(self._wake_addr)
            sock.bind(self.bind)
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # reported to __init__ in the caller's thread
            self._error = e
            sock.close(linger=0)
            wake.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(TICK_S * 1000)))
                if wake in events:
                    while wake.poll(0):
                        wake.recv()
                if sock in events:
                    drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
                with self._lock:
                    version, self._announce = self._announce, None
                if version is not None:
                    frames = encode(ANNOUNCE, {"version": version})
                    for identity in list(self._peers):
                        self._send(sock, identity, frames)
        except BaseException as e:  # thread boundary: publish() re-raises it in the trainer's thread
            logger.exception("weight broadcaster I/O thread died")
            self._error = e
        finally:
            sock.close(linger=0)
            wake.close(linger=0)

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # receiver gone (ROUTER_MANDATORY) or its queue is full
            with self._lock:
                self._counters["send_failed"] += 1
                self._peers.pop(identity, None)
            logger.debug("weight broadcaster: cannot send to %s: %s", identity.hex(), e)
            return False

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        with self._lock:
            self._counters["requests"] += 1
        try:
            kind, body = decode(frames[1:], max_message_bytes=MAX_REQUEST_BYTES)
            _check(kind, body, RECEIVER_KINDS)
            if kind in (WANT, COMMIT):
                check_receiver_id(body["receiver_id"])
        except (DecodeError, ValueError) as e:  # bad input from a peer: counted and dropped, the peer stays
            with self._lock:
                self._counters["bad_messages"] += 1
                self._recent_errors.append((identity.hex(), str(e)[:300]))
                n = self._counters["bad_messages"]
            if n <= 10 or n % 1000 == 0:
                logger.warning("weight broadcaster: rejected message from %s: %s", identity.hex(), e)
            return
        if kind == WANT:
            with self._lock:
                self._peers[identity] = body["receiver_id"]
                if body["committed"] is not None:
                    self._record_commit(body["receiver_id"], body["committed"])
                newest = self._versions[-1] if self._versions else None
            have_inc = body.get("have_incarnation")
            same_timeline = not isinstance(have_inc, str) or have_inc == newest.incarnation if newest else True
            if newest is None or (body["have"] is not None and newest.version <= body["have"] and same_timeline):
                self._send(sock, identity, encode(NONE, {}))  # nothing newer than what it has
            else:
                self._send(sock, identity, newest.manifest)
        elif kind == GET:
            self._get(sock, identity, body["version"], body["index"])
        else:
            with self._lock:
                self._peers[identity] = body["receiver_id"]
                self._record_commit(body["receiver_id"], body["version"])

    def _record_commit(self, receiver_id: str, version: int) -> None:
        if version > self._committed.get(receiver_id, -(2**63)):
            self._committed[receiver_id] = version

    def _get(self, sock: zmq.Socket, identity: bytes, version: int, index: int) -> None:
        with self._lock:
            entry = next((v for v in self._versions if v.version == version), None)
        if entry is None or not 0 <= index < len(entry.buckets):
            with self._lock:
                self._counters["gone"] += 1
            self._send(sock, identity, encode(GONE, {"version": version, "index": index}))
            return
        data = entry.corrupt.get(index, entry.buffers[index])
        if self._send(sock, identity, encode(BUCKET, {"version": version, "index": index, "data": data})):
            with self._lock:
                self._counters["buckets_served"] += 1
                self._counters["bytes_served"] += data.numel()


@dataclass(slots=True)
class _Transfer:
    version: int
    mode: WeightMode
    lora_config: dict[str, Any] | None
    buckets: list[Bucket]
    started: float
    last_progress: float
    next_index: int = 0
    incarnation: str = ""
    inflight: set[int] = field(default_factory=set)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)


class ZmqWeightReceiver(WeightReceiver):
    """Worker end: a DEALER owned by an I/O thread that stages the newest version.

    Args:
        address: the broadcaster's :attr:`~ZmqWeightBroadcaster.address`.
        receiver_id: unique name of this worker (``committed()`` is keyed by it).
        window: bucket requests in flight at once (memory in flight <= window x bucket size).
        timeout_s: how long :meth:`start` waits for the broadcaster's first reply, and how long a
            transfer may go without receiving a bucket before it fails.

    Memory: the staged (not yet committed) update, plus one transfer in progress, plus at most
    ``window`` buckets in flight in ZeroMQ's queues.
    """

    def __init__(self, address: str, *, receiver_id: str, window: int = 2, timeout_s: float = 30.0):
        if window < 1 or timeout_s <= 0:
            raise ValueError(f"{window=} must be >= 1 and {timeout_s=} > 0")
        self.address = address
        self.receiver_id = check_receiver_id(receiver_id)
        self.window = window
        self.timeout_s = timeout_s
        self._staging = StagingArea(receiver_id)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._heard = threading.Event()
        self._commits: collections.deque[int] = collections.deque()
        self._thread: threading.Thread | None = None
        # I/O thread only:
        self._transfer: _Transfer | None = None
        self._next_want = 0.0
        self._failed_version: int | None = None
        self._retry_after = 0.0
        self._last_commit = -1e9
        self._max_bytes = CONTROL_MAX_BYTES  # grows with the largest bucket seen: stale buckets still decode
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop)

    # -- worker thread -------------------------------------------------------------------------
    def start(self) -> None:
        """Connects and waits for the broadcaster's first reply.

        Raises:
            WeightSyncError: if none came within ``timeout_s``.
        """
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"asyncrl-weights-{self.receiver_id}", daemon=True)
        self._thread.start()
        if not self._heard.wait(self.timeout_s):
            self.close()
            raise WeightSyncError(
                f"receiver {self.receiver_id}: no reply from the weight broadcaster at {self.address!r} within "
                f"timeout_s={self.timeout_s}; check the address and that the trainer is running"
            )

    def poll(self) -> WeightUpdate | None:
        return self._staging.poll()

    def wait(self, version: int, timeout: float, *, incarnation: str | None = None) -> WeightUpdate | None:
        return self._staging.wait(version, timeout, incarnation)

    def commit(self, version: int) -> None:
        self._staging.commit(version)
        self._commits.append(version)  # the I/O thread sends it on its next tick

    @property
    def committed_version(self) -> int | None:
        return self._staging.committed_version

    def stats(self) -> dict[str, Any]:
        out = self._staging.stats()
        out.update(receiver_id=self.receiver_id, address=self.address)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._ctx.term()
        self._staging.close()
        self._finalizer()

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                if sock.poll(int(TICK_S * 1000)):
                    drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
                self._tick(sock, time.monotonic())
        except BaseException as e:  # thread boundary: poll()/wait() re-raise it in the worker's thread
            logger.exception("receiver %s: weight I/O thread died", self.receiver_id)
            self._staging.die(e)
        finally:
            # a commit made just before close() still reaches the broadcaster; nothing else is worth waiting for
            sent = self._flush_commits(sock)
            sock.close(linger=COMMIT_LINGER_MS if sent or time.monotonic() - self._last_commit < 1 else 0)

    def _flush_commits(self, sock: zmq.Socket) -> bool:
        sent = False
        while self._commits:
            self._send(sock, COMMIT, {"receiver_id": self.receiver_id, "version": self._commits.popleft()})
            self._last_commit, sent = time.monotonic(), True
        return sent

    def _tick(self, sock: zmq.Socket, now: float) -> None:
        self._flush_commits(sock)
        if now >= self._next_want:
            self._next_want = now + WANT_INTERVAL_S
            self._send(sock, WANT, {"receiver_id": self.receiver_id, "have": self._staging.newest(),
                                    "have_incarnation": self._staging.newest_incarnation(),
                                    "committed": self._staging.committed_version})
        t = self._transfer
        if t is not None and now - t.last_progress > self.timeout_s:
            self._fail(now, f"no bucket of version {t.version} arrived for {self.timeout_s} s (timeout_s)")

    def _send(self, sock: zmq.Socket, kind: str, body: dict[str, Any]) -> None:
        try:
            sock.send_multipart(encode(kind, body), zmq.NOBLOCK)
        except zmq.Again:  # queue to the broadcaster full: WANT is retried, a lost GET ends in timeout_s
            self._staging.count(f"send_dropped_{kind}")

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        now = time.monotonic()
        t = self._transfer
        try:
            kind, body = decode(frames, max_message_bytes=self._max_bytes)
            _check(kind, body, BROADCASTER_KINDS)
        except DecodeError as e:  # bad input: counted; it poisons the transfer it may belong to
            self._staging.count("bad_messages")
            logger.warning("receiver %s: bad message from the weight broadcaster: %s", self.receiver_id, e)
            if t is not None:
                self._fail(now, f"malformed message from the broadcaster: {e}")
            return
        self._heard.set()
        self._staging.set_info(last_heard=time.time())
        if kind == MANIFEST:
            self._manifest(sock, body, now)
        elif kind == BUCKET:
            self._bucket(sock, body, now)
        elif kind == GONE:
            if t is not None and body["version"] == t.version:
                self._fail(now, f"version {t.version} is gone from the broadcaster (newer ones were published)")
                self._next_want = self._retry_after = now  # ask for the newest at once
        elif kind == ANNOUNCE:
            newest = self._staging.newest()
            if (newest is None or body["version"] > newest) and (t is None or body["version"] > t.version):
                self._next_want = now

    def _manifest(self, sock: zmq.Socket, body: dict[str, Any], now: float) -> None:
        version, t = body["version"], self._transfer
        incarnation = body.get("incarnation", "")
        if not isinstance(incarnation, str) or len(incarnation) > 64:
            self._staging.count("bad_messages")
            return
        if not self._staging.is_newer(version, incarnation) or (
            t is not None and incarnation == t.incarnation and version <= t.version
        ):
            return
        if self._failed_version is not None and version <= self._failed_version and now < self._retry_after:
            return
        try:
            if body["mode"] not in MODES or (body["lora_config"] is not None and body["mode"] != "lora"):
                raise DecodeError(f"manifest mode {body['mode']!r:.20} / lora_config do not match")
            buckets = buckets_from_wire(body["buckets"])
        except DecodeError as e:
            self._staging.count("bad_messages")
            self._fail(now, f"malformed manifest of version {version}: {e}", version)
            return
        if t is not None:
            self._staging.count("abandoned")
            logger.info("receiver %s: abandoning version %d for newer %d", self.receiver_id, t.version, version)
        max_bucket = max((b.nbytes for b in buckets), default=0)
        self._max_bytes = max(self._max_bytes, max_bucket + (1 << 20))
        self._transfer = _Transfer(version, body["mode"], body["lora_config"], buckets, now, now, incarnation=incarnation)
        self._request(sock)
        self._maybe_finish(now)

    def _request(self, sock: zmq.Socket) -> None:
        t = self._transfer
        while t is not None and len(t.inflight) < self.window and t.next_index < len(t.buckets):
            self._send(sock, GET, {"version": t.version, "index": t.next_index})
            t.inflight.add(t.next_index)
            t.next_index += 1

    def _bucket(self, sock: zmq.Socket, body: dict[str, Any], now: float) -> None:
        t, index, data = self._transfer, body["index"], body["data"]
        if t is None or body["version"] != t.version or index not in t.inflight:
            self._staging.count("stale_buckets")  # from an abandoned or failed transfer
            return
        bucket = t.buckets[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != bucket.nbytes:
            self._fail(now, f"bucket {index} of version {t.version} is {data.dtype}{list(data.shape)}, "
                            f"the manifest says {bucket.nbytes} bytes")
            return
        private = torch.empty(bucket.nbytes, dtype=torch.uint8)  # never alias the zmq frame
        private.copy_(data)
        checksum = bucket_checksum(memoryview(private.numpy()))
        if checksum != bucket.checksum:
            self._fail(now, f"checksum mismatch in bucket {index} of version {t.version}: "
                            f"got {checksum:#010x}, the manifest says {bucket.checksum:#010x}")
            return
        t.inflight.discard(index)
        t.buffers[index] = private
        t.last_progress = now
        self._staging.count("bytes_received", bucket.nbytes)
        self._request(sock)
        self._maybe_finish(now)

    def _maybe_finish(self, now: float) -> None:
        t = self._transfer
        if t is None or len(t.buffers) < len(t.buckets):
            return
        tensors: dict[str, torch.Tensor] = {}
        for b in t.buckets:
            tensors.update(unpack_bucket(b, t.buffers[b.index]))
        self._transfer = None
        meta = {"receiver_id": self.receiver_id, "buckets": len(t.buckets), "staged_at": time.monotonic(),
                "transfer_s": time.monotonic() - t.started}
        self._staging.stage(WeightUpdate(version=t.version, mode=t.mode, tensors=tensors,
                                         lora_config=t.lora_config, metadata=meta, incarnation=t.incarnation))

    def _fail(self, now: float, reason: str, version: int | None = None) -> None:
        t, self._transfer = self._transfer, None
        version = t.version if t is not None else version
        self._staging.fail(version, reason)
        self._failed_version = version
        self._retry_after = self._next_want = now + RETRY_S
        logger.warning("receiver %s: weight transfer failed (%s); keeping committed version %s, retrying in %.1f s",
                       self.receiver_id, reason, self._staging.committed_version, RETRY_S)
