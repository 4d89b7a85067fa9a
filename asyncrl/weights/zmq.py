"""ZeroMQ backend of weight sync: both ends (bucketed, pipelined, two-phase, pull-the-latest).

Topology: the trainer's :class:`ZmqWeightBroadcaster` binds one ROUTER; each worker's
:class:`ZmqWeightReceiver` connects one DEALER. Messages are those of :mod:`asyncrl.weights.protocol`;
a bucket's bytes travel as their own zero-copy frame.

Who blocks on what:

* Broadcaster: the trainer thread blocks in :meth:`ZmqWeightBroadcaster.publish` while it copies the
  tensors into the version's bucket buffers (each copy fused with the bucket's checksum); it never
  touches the socket. The MANIFEST is announced before the first bucket is written and each bucket is
  served as soon as it is written, so receivers fetch bucket ``i`` while the trainer writes ``i + 1``
  (a GET for an unwritten bucket waits in the I/O thread). One I/O thread owns the ROUTER, polls with a
  short timeout (``TICK_S``) and is woken by the trainer per written bucket. Bucket buffers are reused
  across versions: a version that falls out of the newest ``keep_versions`` lends its buffers to the
  next publish of the same layout once ZeroMQ has released every frame sent from them (a tracker per
  send; after ``REUSE_WAIT_S`` the publish allocates fresh buffers instead, counted).
* Deltas (``delta=True``): encoder threads (:mod:`asyncrl.weights._delta_encoder`) encode each written bucket
  against the previous version, once for every receiver at that base, while the trainer writes the next
  bucket and the I/O thread sends the previous one; a GET for a delta being encoded waits in the I/O
  thread (never blocking it). A publish that reuses a retired version's buffers waits for an encode
  still reading them (one bucket's encode at most). A bucket whose last ``DENSE_AFTER`` deltas were not
  smaller than the bucket (a step that moves nearly every word: fp32 weights, a large learning rate) is
  served full without encoding, except every ``PROBE_EVERY``-th version, which tries again: the compare
  pass is not paid on every update for nothing.
* Receiver: one I/O thread owns the DEALER. It asks WANT on start, on ANNOUNCE and every
  ``WANT_INTERVAL_S`` as a fallback, fetches the newest version with at most ``window`` GETs in flight,
  copies every bucket out of its frame into a reused receive buffer (fused with the checksum), verifies
  it, and stages the update once all buckets are verified; the engine loads from views of those buffers.
  The worker's thread blocks only in :meth:`ZmqWeightReceiver.wait`.

A failed transfer (checksum or size mismatch, GONE, no progress for ``timeout_s``, a malformed
message) is discarded whole, counted in ``stats()["failures"]`` with its reason, logged, and retried
after ``RETRY_S``; the committed version stays in effect. A newer MANIFEST mid-transfer abandons the
older transfer (``stats()["abandoned"]``).

Nobody in by default: a broadcaster binds loopback unless told otherwise, and a non-loopback bind
needs CURVE (``security``: the rollout channel's :class:`~asyncrl.config.TransportConfig`, with its
keys and worker allow-list, enforced by the same ZAP handler) or ``allow_insecure_remote``. A receiver
whose key is not listed fails the handshake and receives nothing (``curve_keys_refused``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from asyncrl._zmq.curve import AllowList, client_secret_key, start_authenticator
from asyncrl._zmq.io import IOThread, Waker, drain, is_loopback_bind
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.config import TransportConfig
from asyncrl.weights import _delta_kernels as delta_kernels
from asyncrl.weights import protocol as P
from asyncrl.weights._checksum import fill_bucket
from asyncrl.weights._delta_encoder import DeltaEncoder
from asyncrl.weights._receiver import StagedReceiver
from asyncrl.weights._staging import check_filled, check_receiver_id, plan_publish, unpack_bucket
from asyncrl.weights.base import Bucket, WeightBroadcaster, WeightMode, WeightSyncError, WeightUpdate
from asyncrl.weights.delta import DeltaBase, DeltaCodec, DeltaRefused, apply_bucket
from asyncrl.weights.delta import encode_bucket as encode_delta

__all__ = ["ZmqWeightBroadcaster", "ZmqWeightReceiver", "check_weight_bind"]

logger = logging.getLogger(__name__)

TICK_S = 0.005
MAX_DRAIN = 64
WANT_INTERVAL_S = 1.0
"""Fallback poll: a receiver asks for the newest version this often even without an ANNOUNCE."""
MAX_REQUEST_BYTES = 1 << 20
CONTROL_MAX_BYTES = 64 << 20
"""Largest manifest a receiver accepts; bucket messages may be as large as the largest bucket seen + 1 MiB."""
SNDHWM = 1000
COMMIT_LINGER_MS = 1000
"""How long close() lets a just-sent COMMIT reach the broadcaster."""
REUSE_WAIT_S = 1.0
"""How long a publish waits for ZeroMQ to release a retired version's buffers before allocating new ones."""
SPARE_SNAPSHOTS = 1
"""Retired bucket-buffer sets kept for reuse (beyond the ``keep_versions`` being served)."""
_ENCODING = object()
"""``_delta_fields``: the bucket's delta is being encoded; the GET waits for it."""
DENSE_AFTER = 2
"""Deltas of a bucket in a row that were not smaller than the bucket after which it counts as dense."""
PROBE_EVERY = 8
"""A dense bucket is encoded again on every version divisible by this (the changes may have become sparse)."""


def check_weight_bind(bind: str, security: TransportConfig | None) -> None:
    """Refuses a non-loopback bind without CURVE unless ``security.allow_insecure_remote``.

    Raises:
        ValueError: naming the settings that fix it.
    """
    curve = security is not None and security.curve_secret_key is not None
    if is_loopback_bind(bind) or curve or (security is not None and security.allow_insecure_remote):
        return
    raise ValueError(
        f"refusing to bind the weight broadcaster to {bind!r} beyond loopback without authentication: pass "
        "security=TransportConfig(curve_secret_key=..., curve_public_key=..., curve_allowed_keys=[worker keys]) "
        "(the rollout channel's transport settings; asyncrl.transport.zmq.generate_curve_keys) or "
        "security=TransportConfig(allow_insecure_remote=True) on a trusted network"
    )


@dataclass(slots=True, eq=False)
class _Snapshot:
    """One version's bucket buffers, reused by later versions of the same layout."""

    layout: tuple[int, ...]
    buffers: list[torch.Tensor]
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    """Sends that may still read the buffers (ZeroMQ sends them zero-copy)."""
    readers: int = 0
    """Delta encodes reading the buffers now (under the broadcaster's ``_lock``)."""

    def released(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self.trackers:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                return False
        self.trackers.clear()
        return True


@dataclass(slots=True, eq=False)
class _Version:
    manifest: P.Manifest
    frames: list[Any]
    """The encoded MANIFEST, sent as is to every WANT."""
    snapshot: _Snapshot
    checksums: list[int] = field(default_factory=list)
    """Checksums of the buckets written so far (``len`` = buckets ready to serve)."""
    waiting: list[tuple[bytes, int]] = field(default_factory=list)
    """GETs (identity, index) for buckets not written yet (I/O thread only)."""
    failed: bool = False
    """The publish raised before every bucket was written: GETs are answered GONE."""
    deltas: dict[tuple[int, Any, Any], Any] = field(default_factory=dict)
    """Deltas encoded so far, by (bucket index, base version, base incarnation); None: sent full (under ``_lock``:
    encoder threads write it, the I/O thread reads it)."""


def _new_snapshot(layout: tuple[int, ...]) -> _Snapshot:
    # zero_() touches every page now, so later versions write into memory that is already faulted in
    return _Snapshot(layout, [torch.empty(n, dtype=torch.uint8).zero_() for n in layout])


class ZmqWeightBroadcaster(WeightBroadcaster):
    """Trainer end: snapshots versions into reused bucket buffers and serves them from a ROUTER's I/O thread.

    Args:
        bind: ZeroMQ endpoint to bind (port 0 picks a free port; :attr:`address` is the real one).
        bucket_bytes: the bucket size (a larger tensor gets its own bucket).
        keep_versions: versions kept for receivers still fetching (the newest is always kept).
        security: CURVE keys and worker allow-list (``curve_secret_key``/``curve_public_key``,
            ``curve_allowed_keys[_file]``, ``curve_allow_any_client``) and ``allow_insecure_remote``, read from
            the rollout channel's transport settings; its ``bind`` is not used.
        delta: serve a bucket as a delta (:mod:`asyncrl.weights.delta`) against the base a receiver's GET
            names, when that version is still among the ``keep_versions`` kept here and the delta is smaller;
            otherwise, and for receivers that name none, the full bucket. Encoded once per (bucket, base), shared
            by every receiver at that base, in encoder threads (:mod:`asyncrl.weights._delta_encoder`): once some
            receiver has asked for deltas, each bucket is encoded against the previous version as soon as the
            publish has written it (a receiver's base is the version it committed, usually the previous one),
            so encoding overlaps the sends and the receivers' decoding; a GET naming another base waits for
            its encode.
        delta_threads: encoder threads (``weights.delta_threads``; buckets of a version are encoded in parallel
            across them). 1 by default: on a 2-core machine 2 threads cost more CPU (contention) and were
            slower end to end (``benchmarks/weight_delta.py --delta-threads 1,2``); more may pay on a trainer
            with idle cores.

    Raises:
        ValueError: for a non-loopback bind without CURVE, or CURVE without an allow-list of worker keys.
        WeightSyncError: if the endpoint cannot be bound.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, bucket_bytes: int = 64 << 20, keep_versions: int = 2,
                 security: TransportConfig | None = None, delta: bool = False, delta_threads: int = 1):
        if bucket_bytes <= 0 or keep_versions < 1 or delta_threads < 1:
            raise ValueError(f"{bucket_bytes=} must be > 0, {keep_versions=} >= 1 and {delta_threads=} >= 1")
        check_weight_bind(bind, security)
        WeightBroadcaster.__init__(self)
        self._curve = security if security is not None and security.curve_secret_key is not None else None
        # the rollout channel's allow-list, watched the same way (a key left out of its file is refused from then on)
        self._allowed = (AllowList.from_config(self._curve, count=lambda name: self._count(name))
                         if self._curve is not None and not self._curve.curve_allow_any_client else None)
        listed = self._curve is not None and (self._curve.curve_allowed_keys or
                                              self._curve.curve_allowed_keys_file is not None)
        if self._curve is not None and not listed and not self._curve.curve_allow_any_client:
            raise ValueError("a CURVE weight broadcaster needs an allow-list of worker public keys: set "
                             "curve_allowed_keys or curve_allowed_keys_file in its security settings, or "
                             "curve_allow_any_client=True to serve any key")
        self.bind = bind
        self.bucket_bytes = bucket_bytes
        self.keep_versions = keep_versions
        self.delta = delta
        self._codecs = threading.local()  # a DeltaCodec per encoder thread
        self._bases: dict[bytes, tuple[int, str]] = {}  # the base each receiver's last GET named (I/O thread)
        self._delta_wanted = False  # some receiver named a base: encode each new bucket at once (eagerly)
        self._not_smaller: dict[int, int] = {}  # bucket index -> its deltas in a row not smaller than it (_lock)
        self._io = IOThread(self, "asyncrl-weight-broadcaster")
        self._ctx = self._io.ctx
        self._lock = threading.Lock()
        self._read_done = threading.Condition(self._lock)  # an encode stopped reading a snapshot (_Snapshot.readers)
        self._versions: collections.deque[_Version] = collections.deque()
        self._spare: list[_Snapshot] = []
        self._announce: int | None = None
        self._waker = Waker(self._ctx, "weights")
        self._committed: dict[str, int] = {}
        self._peers: dict[bytes, str] = {}
        self._counters: collections.Counter[str] = collections.Counter()
        self._recent_errors: collections.deque[tuple[str, str]] = collections.deque(maxlen=32)
        self._ready = threading.Event()
        self._endpoint: str | None = None
        self._pending: list[_Version] = []  # versions with GETs waiting for a bucket (I/O thread only)
        self._encoder = DeltaEncoder(self, threads=delta_threads, on_error=self._encode_failed) if delta else None
        if self._encoder is not None:  # the delta kernels compile (or load from numba's cache) before any bucket
            self._encoder.submit(("warm",), delta_kernels.warm)
        self._io.start(self._run)
        if not self._ready.wait(30) or self._endpoint is None:
            self.close()
            raise WeightSyncError(f"weight broadcaster could not bind {bind!r}") from self._error

    # -- trainer thread ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint

    def _publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, mode: WeightMode,
                 lora_config: dict[str, Any] | None, incarnation: str,
                 plan: Sequence[Bucket] | None = None) -> dict[str, Any]:
        buckets = plan_publish(tensors, version, self._last_version, mode, lora_config, self.bucket_bytes, plan)
        manifest = P.Manifest(version=version, incarnation=incarnation, mode=mode, lora_config=lora_config,
                              buckets=buckets)
        frames = encode(P.MANIFEST, manifest.to_wire())  # TypeError here for a lora_config msgpack refuses
        with self._lock:  # retired first, so that this version can reuse the oldest one's buffers
            while len(self._versions) >= self.keep_versions:
                self._retire(self._versions.popleft())
        entry = _Version(manifest, frames, self._snapshot(tuple(b.nbytes for b in buckets)))
        with self._lock:
            self._versions.append(entry)
            self._last_version = version
            self._announce = version
            self._counters["versions_published"] += 1
        self._wake()  # the MANIFEST goes out now; receivers GET buckets as they are written
        t1 = time.perf_counter()
        try:
            for b, buf in zip(buckets, entry.snapshot.buffers):
                checksum = check_filled(b, self._fill(b, tensors, buf), plan is not None)
                with self._lock:
                    entry.checksums.append(checksum)
                self._encode_eagerly(entry, b.index)
                self._wake()
        except BaseException:
            with self._lock:  # no longer offered: receivers fail what they fetched of it and keep theirs
                entry.failed = True
                self._versions = collections.deque(v for v in self._versions if v is not entry)  # identity
            self._wake()
            raise
        return {"bytes": manifest.nbytes, "buckets": len(buckets), "snapshot_s": time.perf_counter() - t1}

    def _fill(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> int:
        """Copies one bucket into its buffer and returns its checksum (the per-bucket write; tests that
        corrupt a bucket after its checksum override this)."""
        return fill_bucket(bucket, tensors, out)

    def _snapshot(self, layout: tuple[int, ...]) -> _Snapshot:
        """Bucket buffers for a version: a retired set of the same layout once ZeroMQ released it, else new."""
        with self._lock:
            spare = next((s for s in self._spare if s.layout == layout), None)
            if spare is not None:
                self._spare.remove(spare)
                # not while an encode still reads the retired set (a wait of one bucket's encode at most)
                self._read_done.wait_for(lambda: spare.readers == 0)
        if spare is not None:
            if spare.released(REUSE_WAIT_S):
                self._counters["snapshots_reused"] += 1
                return spare
            self._counters["snapshots_busy"] += 1  # a frame of it still queued in ZeroMQ after REUSE_WAIT_S
        self._counters["snapshots_allocated"] += 1
        return _new_snapshot(layout)

    def _retire(self, entry: _Version) -> None:
        """(Under ``_lock``.) A version no longer served lends its buffers to a later publish."""
        self._spare.insert(0, entry.snapshot)
        del self._spare[SPARE_SNAPSHOTS:]

    def _wake(self) -> None:
        """Wakes the I/O thread: an ANNOUNCE or a newly written bucket goes out now, not on its next tick."""
        self._waker.wake()

    def committed(self) -> dict[str, int]:
        with self._lock:
            return dict(self._committed)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"requests": 0, "bytes_served": 0, "bad_messages": 0}
            out.update(self._counters)
            out["versions"] = [v.manifest.version for v in self._versions]
            out["receivers"] = sorted(set(self._peers.values()))
            out["recent_errors"] = list(self._recent_errors)
        return out

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
        self._io.close(before_join=self._waker.close)
        with self._lock:
            self._versions.clear()
            self._spare.clear()

    # -- I/O thread ----------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone receiver raises instead of vanishing silently
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if self._curve is not None:
            sock.curve_secretkey = self._curve.curve_secret_key.encode()  # type: ignore[union-attr]
            sock.curve_publickey = self._curve.curve_public_key.encode()  # type: ignore[union-attr]
            sock.curve_server = True
        try:
            sock.bind(self.bind)
        except BaseException:
            sock.close(linger=0)  # else the context's term() waits for it forever
            raise
        return sock

    def _run(self) -> None:
        auth = sock = None
        wake = None
        try:
            # the ZAP handler first: libzmq asks it at every CURVE handshake on the socket bound next
            auth = start_authenticator(self._ctx, self._allowed, self._count) if self._curve is not None else None
            wake = self._waker.pull()
            sock = self._open()
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # reported to __init__ in the caller's thread
            self._error = e
            for s in (sock, wake):
                if s is not None:
                    s.close(linger=0)
            if auth is not None:
                auth.stop()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(sock, wake)
        except BaseException as e:  # thread boundary: publish() re-raises it in the trainer's thread
            logger.exception("weight broadcaster I/O thread died")
            self._error = e
        finally:
            sock.close(linger=0)
            wake.close(linger=0)
            if auth is not None:
                auth.stop()

    def _loop(self, sock: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        while not self._io.stop.is_set():
            events = dict(poller.poll(int(TICK_S * 1000)))
            if wake in events:
                while wake.poll(0):
                    wake.recv()
            if sock in events:
                drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
            with self._lock:
                version, self._announce = self._announce, None
            if version is not None:
                frames = encode(P.ANNOUNCE, {"version": version})
                for identity in list(self._peers):
                    self._send(sock, identity, frames)
            if self._pending:
                pending, self._pending = self._pending, []
                for entry in pending:  # GETs that wait for a bucket being written (GONE if retired meanwhile)
                    waiting, entry.waiting = entry.waiting, []
                    for identity, index in waiting:
                        self._get(sock, identity, entry, index)

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[Any],
              track: bool = False) -> zmq.MessageTracker | None:
        try:
            tracker = sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False, track=track)
            return tracker if track else None
        except zmq.ZMQError as e:  # receiver gone (ROUTER_MANDATORY) or its queue is full
            with self._lock:
                self._counters["send_failed"] += 1
                self._peers.pop(identity, None)
            logger.debug("weight broadcaster: cannot send to %s: %s", identity.hex(), e)
            return None

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        self._count("requests")
        if self._allowed is not None:  # a key revoked since its handshake: refused from then on, as by the pool
            self._allowed.refresh()  # a stat per request (a few per version and receiver)
            if not self._allowed.admits(frames[-1].get("User-Id")):
                self._count("curve_key_revoked_messages")
                with self._lock:
                    self._peers.pop(identity, None)
                return
        try:
            kind, body = decode(frames[1:], max_message_bytes=MAX_REQUEST_BYTES)
            P.check_message(kind, body, P.RECEIVER_KINDS)
            if kind in (P.WANT, P.COMMIT):
                check_receiver_id(body["receiver_id"])
        except (DecodeError, ValueError) as e:  # bad input from a peer: counted and dropped, the peer stays
            with self._lock:
                self._counters["bad_messages"] += 1
                self._recent_errors.append((identity.hex(), str(e)[:300]))
                n = self._counters["bad_messages"]
            if n <= 10 or n % 1000 == 0:
                logger.warning("weight broadcaster: rejected message from %s: %s", identity.hex(), e)
            return
        if kind == P.WANT:
            self._want(sock, identity, body)
        elif kind == P.GET:
            self._note_base(identity, body)
            with self._lock:
                entry = next((v for v in self._versions if v.manifest.version == body["version"]), None)
            self._get(sock, identity, entry, body["index"], body["version"])
        else:
            with self._lock:
                self._peers[identity] = body["receiver_id"]
                self._record_commit(body["receiver_id"], body["version"])

    def _want(self, sock: zmq.Socket, identity: bytes, body: dict[str, Any]) -> None:
        with self._lock:
            self._peers[identity] = body["receiver_id"]
            if body["committed"] is not None:
                self._record_commit(body["receiver_id"], body["committed"])
            newest = self._versions[-1] if self._versions else None
        if newest is None:
            self._send(sock, identity, encode(P.NONE, {}))
            return
        have_inc = body.get("have_incarnation")
        same_timeline = not isinstance(have_inc, str) or have_inc == newest.manifest.incarnation
        if body["have"] is not None and newest.manifest.version <= body["have"] and same_timeline:
            self._send(sock, identity, encode(P.NONE, {}))  # nothing newer than what it has
        else:
            self._send(sock, identity, newest.frames)

    def _record_commit(self, receiver_id: str, version: int) -> None:
        if version > self._committed.get(receiver_id, -(2**63)):
            self._committed[receiver_id] = version

    def _get(self, sock: zmq.Socket, identity: bytes, entry: _Version | None, index: int,
             version: int | None = None) -> None:
        with self._lock:
            live = entry is not None and any(v is entry for v in self._versions) and not entry.failed
            ready = len(entry.checksums) if entry is not None else 0
        if not live or not 0 <= index < len(entry.manifest.buckets):  # type: ignore[union-attr]
            self._count("gone")
            v = entry.manifest.version if entry is not None else version
            self._send(sock, identity, encode(P.GONE, {"version": v, "index": index}))
            return
        if index >= ready:  # not written yet: answered once it is (the publish wakes this thread)
            if not entry.waiting:
                self._pending.append(entry)
            entry.waiting.append((identity, index))
            return
        fields = self._delta_fields(entry, index, identity)
        if fields is _ENCODING:  # served once the encoder is done (it wakes this thread)
            if not entry.waiting:
                self._pending.append(entry)
            entry.waiting.append((identity, index))
            return
        fields = fields or P.encode_bucket(entry.snapshot.buffers[index])
        data = fields["data"]
        body = {"version": entry.manifest.version, "index": index, "checksum": entry.checksums[index], **fields}
        tracker = self._send(sock, identity, encode(P.BUCKET, body), track=True)
        if tracker is not None:
            with self._lock:
                trackers = entry.snapshot.trackers
                trackers.append(tracker)
                if len(trackers) > 256:
                    trackers[:] = [t for t in trackers if not t.done]
                self._counters["buckets_served"] += 1
                self._counters["bytes_served"] += data.numel()
                how = "delta" if "delta" in fields else "full"
                self._counters[f"{how}_bytes"] += data.numel()
                self._counters[f"buckets_{how}"] += 1

    def _note_base(self, identity: bytes, body: dict[str, Any]) -> None:
        """Remembers the base a GET names (``base_version``, ``base_incarnation``; peer input, checked)."""
        version, incarnation = body.get("base_version"), body.get("base_incarnation", "")
        if type(version) is int and isinstance(incarnation, str) and len(incarnation) <= P.MAX_INCARNATION_CHARS:
            self._bases[identity] = (version, incarnation)
            self._delta_wanted = self.delta
        else:
            self._bases.pop(identity, None)

    def _delta_fields(self, entry: _Version, index: int, identity: bytes) -> dict[str, Any] | None | object:
        """BUCKET fields of bucket ``index`` as a delta against the base the receiver named, None (send it full:
        deltas off, no base named, that version not kept here, another layout, a delta not smaller), or
        ``_ENCODING`` while its encode is queued or running (this call queues it if it is neither)."""
        base = self._bases.get(identity) if self._encoder is not None else None
        if base is None:
            return None
        key = (index, *base)
        with self._lock:
            if key not in entry.deltas and self._dense(index, entry.manifest.version):
                entry.deltas[key] = None  # served full, not encoded
                self._counters["deltas_skipped_dense"] += 1
            done, delta = key in entry.deltas, entry.deltas.get(key)
        if done:
            return None if delta is None else {"data": torch.from_numpy(delta.payload), "delta": delta.header()}
        if not self._encoder.alive:  # type: ignore[union-attr]  # closing: full
            return None
        self._submit_encode(entry, key)
        return _ENCODING

    # -- encoder threads (asyncrl.weights._delta_encoder) ----------------------------------------
    def _encode_eagerly(self, entry: _Version, index: int) -> None:
        """(Trainer thread, once bucket ``index`` of ``entry`` is written.) Queues its delta against the previous
        version, the base of every receiver that committed it, once some receiver has asked for deltas."""
        if self._encoder is None or not self._delta_wanted:
            return
        with self._lock:
            if self._dense(index, entry.manifest.version):
                return  # a GET for it is answered full (_delta_fields)
            base = next((v for v in reversed(self._versions) if v is not entry and not v.failed
                         and len(v.checksums) == len(v.manifest.buckets)), None)
        if base is not None:
            self._submit_encode(entry, (index, base.manifest.version, base.manifest.incarnation))

    def _dense(self, index: int, version: int) -> bool:
        """(Under ``_lock``.) Whether bucket ``index`` of ``version`` is served full without trying a delta: its last
        :data:`DENSE_AFTER` deltas were not smaller, and this is not a probing version (:data:`PROBE_EVERY`)."""
        return self._not_smaller.get(index, 0) >= DENSE_AFTER and version % PROBE_EVERY != 0

    def _submit_encode(self, entry: _Version, key: tuple[int, int, str]) -> None:
        m = entry.manifest
        self._encoder.submit((m.version, m.incarnation, *key), lambda: self._encode(entry, key))  # type: ignore[union-attr]

    def _encode(self, entry: _Version, key: tuple[int, int, str]) -> None:
        """(Encoder thread.) Encodes bucket ``key[0]`` of ``entry`` against the kept version ``key[1:]`` into
        ``entry.deltas`` (None: serve it full), then wakes the I/O thread for the GETs parked on it."""
        index, base = key[0], key[1:]
        delta, outcome, t0, cpu0, reading = None, None, time.perf_counter(), time.thread_time(), ()
        try:
            with self._lock:
                if key in entry.deltas:
                    return
                live = any(v is entry for v in self._versions) and not entry.failed
                held = next((v for v in self._versions if v is not entry and not v.failed
                             and (v.manifest.version, v.manifest.incarnation) == base
                             and index < len(v.checksums)), None)
                if live and held is not None:  # their buffers are not handed to a new publish meanwhile
                    reading = (entry.snapshot, held.snapshot)
                    for snap in reading:
                        snap.readers += 1
            if not live:  # withdrawn or retired: its GETs are answered GONE
                return
            outcome = "base_not_held"
            if held is not None:
                codec = getattr(self._codecs, "codec", None) or DeltaCodec()
                self._codecs.codec = codec
                delta = encode_delta(codec, entry.manifest.buckets[index], entry.snapshot.buffers[index],
                                     held.manifest.buckets[index], held.snapshot.buffers[index],
                                     base_version=base[0], base_incarnation=base[1], checksum=entry.checksums[index])
                outcome = "not_smaller" if delta is None else "encoded"
        finally:  # always recorded (None after an error: served full), so that no GET waits for it forever
            with self._lock:
                for snap in reading:
                    snap.readers -= 1
                self._read_done.notify_all()
                entry.deltas.setdefault(key, delta)
                if outcome == "not_smaller":
                    self._not_smaller[index] = self._not_smaller.get(index, 0) + 1
                elif outcome == "encoded":
                    self._not_smaller[index] = 0
                if outcome is not None:
                    self._counters["delta_encode_s"] += time.perf_counter() - t0
                    self._counters["delta_encode_cpu_s"] += time.thread_time() - cpu0
                    self._counters[f"deltas_{outcome}"] += 1
            self._wake()

    def _encode_failed(self, error: BaseException) -> None:
        self._count("delta_encode_errors")


@dataclass(slots=True)
class _Transfer:
    manifest: P.Manifest
    buffers: list[torch.Tensor]
    started: float
    last_progress: float
    next_index: int = 0
    inflight: set[int] = field(default_factory=set)
    verified: int = 0
    checksums: dict[int, int] = field(default_factory=dict)
    """The checksum each verified bucket was verified against, by index."""


class _BufferPool:
    """Receive buffers by layout, reused across versions; released ones come back from any thread."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._free: collections.deque[tuple[tuple[int, ...], list[torch.Tensor]]] = collections.deque()
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self, layout: tuple[int, ...]) -> list[torch.Tensor]:
        with self._lock:
            for k, (have, buffers) in enumerate(self._free):
                if have == layout:
                    del self._free[k]  # by position: comparing buffers would compare tensors
                    return buffers
        self.allocated += 1
        return [torch.empty(n, dtype=torch.uint8).zero_() for n in layout]  # touched: no page faults later

    def give(self, layout: tuple[int, ...], buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._free.appendleft((layout, buffers))
            while len(self._free) > self.keep:
                self._free.pop()


class ZmqWeightReceiver(StagedReceiver):
    """Worker end: a DEALER owned by an I/O thread that stages the newest version.

    Args:
        address: the broadcaster's :attr:`~ZmqWeightBroadcaster.address`.
        receiver_id: unique name of this worker (``committed()`` is keyed by it).
        window: bucket requests in flight at once (memory in flight <= window x bucket size).
        timeout_s: how long :meth:`start` waits for the broadcaster's first reply, and how long a
            transfer may go without receiving a bucket before it fails.
        server_key: the broadcaster's CURVE public key, when it uses CURVE.
        security: this worker's own CURVE key (``curve_client_secret_key`` or ``curve_client_key_file``,
            the rollout channel's transport settings); without one, a throw-away key pair (refused by an
            allow-list).
        delta: keep the committed version's buffers as the base (:class:`~asyncrl.weights.delta.DeltaBase`,
            one more set of receive buffers), name it in every GET and rebuild the buckets that come as deltas;
            a delta refused (its base is not the one held, malformed, or its result fails the checksum) is
            counted in ``stats()["delta_refused_<reason>"]`` and that bucket fetched again in full.

    Memory: the update handed to the engine, the staged one and the transfer in progress, each in a reused
    set of receive buffers (one set when the worker applies each version before the next arrives), plus at
    most ``window`` buckets in flight in ZeroMQ's queues.
    """

    uses_zmq = True

    def __init__(self, address: str, *, receiver_id: str, window: int = 2, timeout_s: float = 30.0,
                 server_key: str | None = None, security: TransportConfig | None = None, delta: bool = False):
        if window < 1 or timeout_s <= 0:
            raise ValueError(f"{window=} must be >= 1 and {timeout_s=} > 0")
        super().__init__(address, receiver_id=receiver_id)
        self.window = window
        self.timeout_s = timeout_s
        self.server_key = server_key
        secret = client_secret_key(security) if security is not None else None
        self._client_keys = (zmq.curve_public(secret.encode()), secret.encode()) if secret else zmq.curve_keypair()
        self._heard = threading.Event()
        self._commits: collections.deque[int] = collections.deque()
        self._pool = _BufferPool()
        self._delta_base = DeltaBase() if delta else None
        self._codec = DeltaCodec()  # I/O thread only
        if delta:  # the delta kernels compile (or load from numba's cache) while the first, full, version arrives
            threading.Thread(target=delta_kernels.warm, name=f"asyncrl-delta-warm-{receiver_id}", daemon=True).start()
        # I/O thread only:
        self._transfer: _Transfer | None = None
        self._next_want = 0.0
        self._last_commit = -1e9
        self._max_bytes = CONTROL_MAX_BYTES  # grows with the largest bucket seen: stale buckets still decode

    # -- worker thread -------------------------------------------------------------------------
    def _wait_started(self) -> None:
        """Waits for the broadcaster's first reply.

        Raises:
            WeightSyncError: if none came within ``timeout_s``.
        """
        if not self._heard.wait(self.timeout_s):
            self.close()
            raise WeightSyncError(
                f"receiver {self.receiver_id}: no reply from the weight broadcaster at {self.address!r} within "
                f"timeout_s={self.timeout_s}; check the address, that the trainer is running and, with CURVE, "
                "server_key and that this worker's key is in the broadcaster's allow-list"
            )

    def _on_commit(self, version: int) -> None:
        self._commits.append(version)  # the I/O thread sends it on its next tick

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["receive_buffers_allocated"] = self._pool.allocated
        return out

    # -- I/O thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.server_key is not None:
            sock.curve_serverkey = self.server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = self._client_keys
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                if sock.poll(int(TICK_S * 1000)):
                    drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
                self._tick(sock, time.monotonic())
        finally:
            # a commit made just before close() still reaches the broadcaster; nothing else is worth waiting for
            sent = self._flush_commits(sock)
            sock.close(linger=COMMIT_LINGER_MS if sent or time.monotonic() - self._last_commit < 1 else 0)

    def _flush_commits(self, sock: zmq.Socket) -> bool:
        sent = False
        while self._commits:
            self._send(sock, P.COMMIT, {"receiver_id": self.receiver_id, "version": self._commits.popleft()})
            self._last_commit, sent = time.monotonic(), True
        return sent

    def _tick(self, sock: zmq.Socket, now: float) -> None:
        self._flush_commits(sock)
        if now >= self._next_want:
            self._next_want = now + WANT_INTERVAL_S
            self._send(sock, P.WANT, {"receiver_id": self.receiver_id, "have": self._staging.newest(),
                                      "have_incarnation": self._staging.newest_incarnation(),
                                      "committed": self._staging.committed_version})
        t = self._transfer
        if t is not None and now - t.last_progress > self.timeout_s:
            self._fail_transfer(now, f"no bucket of version {t.manifest.version} arrived for {self.timeout_s} s "
                                     "(timeout_s)")

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
            P.check_message(kind, body, P.BROADCASTER_KINDS)
        except DecodeError as e:  # bad input: counted; it poisons the transfer it may belong to
            self._staging.count("bad_messages")
            logger.warning("receiver %s: bad message from the weight broadcaster: %s", self.receiver_id, e)
            if t is not None:
                self._fail_transfer(now, f"malformed message from the broadcaster: {e}")
            return
        self._heard.set()
        self._staging.set_info(last_heard=time.time())
        if kind == P.MANIFEST:
            self._manifest(sock, body, now)
        elif kind == P.BUCKET:
            self._bucket(sock, body, now)
        elif kind == P.GONE:
            if t is not None and body["version"] == t.manifest.version:
                self._fail_transfer(now, f"version {t.manifest.version} is gone from the broadcaster "
                                         "(newer ones were published)")
                self._next_want = self._retry_after = now  # ask for the newest at once
        elif kind == P.ANNOUNCE:
            newest = self._staging.newest()
            if (newest is None or body["version"] > newest) and (t is None or body["version"] > t.manifest.version):
                self._next_want = now

    def _manifest(self, sock: zmq.Socket, body: dict[str, Any], now: float) -> None:
        try:
            m = P.Manifest.from_wire(body)
        except DecodeError as e:
            self._staging.count("bad_messages")
            self._fail_transfer(now, f"malformed manifest: {e}", body.get("version"))
            return
        t = self._transfer
        if not self._staging.is_newer(m.version, m.incarnation) or (
            t is not None and m.incarnation == t.manifest.incarnation and m.version <= t.manifest.version
        ):
            return
        if not self._retry_due(m.version, now):
            return
        if t is not None:
            self._staging.count("abandoned")
            logger.info("receiver %s: abandoning version %d for newer %d", self.receiver_id, t.manifest.version,
                        m.version)
            self._drop_transfer()
        max_bucket = max((b.nbytes for b in m.buckets), default=0)
        self._max_bytes = max(self._max_bytes, max_bucket + (1 << 20))
        self._transfer = _Transfer(m, self._pool.take(tuple(b.nbytes for b in m.buckets)), now, now)
        self._request(sock)
        self._maybe_finish(now)

    def _request(self, sock: zmq.Socket) -> None:
        t = self._transfer
        while t is not None and len(t.inflight) < self.window and t.next_index < len(t.manifest.buckets):
            self._send(sock, P.GET, {"version": t.manifest.version, "index": t.next_index, **self._base_fields()})
            t.inflight.add(t.next_index)
            t.next_index += 1

    def _bucket(self, sock: zmq.Socket, body: dict[str, Any], now: float) -> None:
        t, index = self._transfer, body["index"]
        if t is None or body["version"] != t.manifest.version or index not in t.inflight:
            self._staging.count("stale_buckets")  # from an abandoned or failed transfer
            return
        bucket = t.manifest.buckets[index]
        try:
            want = P.check_checksum(body["checksum"], f"bucket {index} of version {t.manifest.version}")
            got = self._receive_bucket(bucket, body, t.buffers[index])
        except DeltaRefused as e:  # heal: this bucket again, in full; the transfer goes on
            self._staging.count("delta_refused")
            self._staging.count(f"delta_refused_{e.reason}")
            logger.warning("receiver %s: delta for bucket %d of version %d refused (%s: %s); fetching it in full",
                           self.receiver_id, index, t.manifest.version, e.reason, e)
            self._send(sock, P.GET, {"version": t.manifest.version, "index": index})  # no base named: full
            return  # not progress: a broadcaster that keeps sending refused deltas ends in timeout_s
        except DecodeError as e:
            self._fail_transfer(now, f"version {t.manifest.version}: {e}")
            return
        if got != want:
            self._staging.count("checksum_mismatches")
            self._fail_transfer(now, f"checksum mismatch in bucket {index} of version {t.manifest.version}: "
                                     f"got {got:#018x}, the broadcaster says {want:#018x}")
            return
        t.inflight.discard(index)
        t.checksums[index] = got
        t.verified += 1
        t.last_progress = now
        self._staging.count("bytes_received", bucket.nbytes)
        self._request(sock)
        self._maybe_finish(now)

    def _receive_bucket(self, bucket: Bucket, body: dict[str, Any], out: torch.Tensor) -> int:
        """Writes one received bucket into its reused buffer; returns the checksum of what was written (the
        per-bucket receive step; a test slows it down to kill a receiver mid-transfer).

        Raises:
            DeltaRefused: a delta this receiver cannot apply (fetch the bucket in full).
        """
        data = body.get("data")
        wire = data.nbytes if isinstance(data, torch.Tensor) else 0
        if "delta" not in body:
            self._staging.count("full_bytes", wire)
            self._staging.count("buckets_full")
            return P.decode_bucket(bucket, body, out)
        if self._delta_base is None or not isinstance(data, torch.Tensor):
            raise DeltaRefused("malformed", f"a delta for bucket {bucket.index} with data of type "
                                            f"{type(data).__name__} (this receiver asked for "
                                            f"{'deltas' if self._delta_base else 'no deltas'})")
        t0, cpu0 = time.perf_counter(), time.thread_time()
        apply_bucket(self._codec, self._delta_base, bucket, body["delta"], data, checksum=body["checksum"], out=out)
        self._staging.count("delta_decode_s", time.perf_counter() - t0)
        self._staging.count("delta_decode_cpu_s", time.thread_time() - cpu0)
        self._staging.count("delta_bytes", wire)
        self._staging.count("buckets_delta")
        return body["checksum"]  # apply_bucket verified the result against it

    def _base_fields(self) -> dict[str, Any]:
        """What a GET says about this receiver's base (nothing without one: the bucket comes full)."""
        version, incarnation = self._delta_base.key() if self._delta_base is not None else (None, "")
        return {} if version is None else {"base_version": version, "base_incarnation": incarnation}

    def _maybe_finish(self, now: float) -> None:
        t = self._transfer
        if t is None or t.verified < len(t.manifest.buckets):
            return
        tensors: dict[str, torch.Tensor] = {}
        for b in t.manifest.buckets:
            tensors.update(unpack_bucket(b, t.buffers[b.index]))
        self._transfer = None
        m = t.manifest
        # the plan it arrived in, each bucket with the checksum it was verified against: a relay re-serves the
        # version in it, held to those checksums (WeightBroadcaster.publish(plan=...))
        plan = [dataclasses.replace(b, checksum=t.checksums[b.index]) for b in m.buckets]
        meta = {"receiver_id": self.receiver_id, "buckets": len(m.buckets), "plan": plan, "staged_at": time.monotonic(),
                "transfer_s": time.monotonic() - t.started}
        layout, buffers = tuple(b.nbytes for b in m.buckets), t.buffers
        release = lambda: self._pool.give(layout, buffers)
        if self._delta_base is not None:  # the committed version's buffers stay, as the base
            give, base, staging = release, self._delta_base, self._staging
            release = lambda: base.release(m.version, m.incarnation, m.buckets, buffers, give,
                                           committed=staging.committed_version == m.version)
        self._stage(WeightUpdate(version=m.version, mode=m.mode, tensors=tensors, lora_config=m.lora_config,
                                 metadata=meta, incarnation=m.incarnation), release=release)

    def _drop_transfer(self) -> None:
        t, self._transfer = self._transfer, None
        if t is not None:
            self._pool.give(tuple(b.nbytes for b in t.manifest.buckets), t.buffers)

    def _fail_transfer(self, now: float, reason: str, version: int | None = None) -> None:
        t = self._transfer
        version = t.manifest.version if t is not None else version
        self._drop_transfer()
        self._fail(version if isinstance(version, int) else None, reason, now)
        self._next_want = self._retry_after

