"""CUDA IPC backend of weight sync (``weights.type: cuda_ipc``): receivers on the trainer's node, GPU to GPU.

The broadcaster owns two persistent GPU *slots* per weight layout (double buffering), each one allocation::

    slot = [header: int64 publish, version, checksum, nbytes, 0 x 4][the version's buckets back to back]

Their CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``'s fields, sent as a msgpack map:
:class:`IpcHandle`; never a pickle) and an interprocess CUDA event per slot travel once; a receiver opens each
slot the first time it sees it (the first open in a process costs seconds on an H200: do it at start-up, which
:meth:`CudaIpcWeightBroadcaster.prepare` makes possible before the first version) and keeps it open. Control
messages go over one ZeroMQ ROUTER/DEALER pair, by default on an ``ipc://`` socket in a private (0700) directory,
so only the trainer's user on this node can connect::

    trainer thread: publish(tensors, v)      side stream: wait for the trainer's stream, copy every tensor into the
                                             free slot (torch._foreach_copy_), word-sum checksum into the header,
                                             record the slot's event; the trainer's stream waits for the side stream
                  ──► VERSION {version, incarnation, mode, buckets, slot, publish, slots: [{id, handle, event}]}
    receiver I/O thread: open new slots; its stream waits on the slot's event, sums the slot's words, reads the
                         header (one host sync): publish, version and checksum agree -> stage views into the slot
                  ◄── RELEASE {receiver_id, slot, publish}  once the engine's copy out of the slot has completed
                  ◄── WANT {receiver_id, have, have_incarnation}   (start-up, then every WANT_INTERVAL_S)
                  ◄── COMMIT {receiver_id, version}                (phase two)

Two-phase: the staged update's tensors are views into the slot (verified, read-only by contract); the engine
copies them into its own tensors at a safe point (one ``copy_`` when its tensors are views of one flat buffer in
the same layout, else ``torch._foreach_copy_``: :func:`copy_into`) and commits. Double buffering: version ``v`` is
written into the slot ``v - 1`` is not in; before the broadcaster writes a slot again it waits for every receiver
that was sent the slot's previous version to RELEASE it (the receiver does once the engine's GPU reads of it
finished: it records an event on the committing thread's stream and releases when it has passed). A receiver that
holds a slot past ``slot_wait_s`` (stuck, dead) is not waited for further: the broadcaster allocates a fresh slot
(``stats()["slots_replaced"]``; receivers open it on sight) and drops the old one, whose memory torch's IPC
reference counting keeps alive while a receiver still has it open.

Who blocks on what: the trainer thread blocks in :meth:`CudaIpcWeightBroadcaster.publish` only while it waits for
a slot (at most ``slot_wait_s``) and while it enqueues the copies (GPU work is asynchronous; the trainer's stream
is ordered after it). The broadcaster's I/O thread owns the ROUTER and polls with a short timeout. Each receiver's
I/O thread owns its DEALER and blocks in one stream synchronize per version (the verification); the worker's
thread blocks only in :meth:`CudaIpcWeightReceiver.wait`.

The checksum is the wrapping sum of the slot's 64-bit words, computed on the GPU at both ends: it catches a slot
that was overwritten or not yet written when read (the race this protocol exists to prevent), not an adversary;
nothing here crosses a machine.

The device operations sit behind :class:`~asyncrl.weights._ipc_memory.IpcMemory` (:class:`CudaIpcMemory` by
default); tests without CUDA run the whole protocol over a file-backed stand-in with the same interface.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import NoneType
from typing import Any

import torch
import zmq

from asyncrl._owned_dir import OwnedDir, make_owned_dir
from asyncrl._zmq.io import IOThread, Waker, drain, is_loopback_bind
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.transport.protocol import check_fields
from asyncrl.weights._ipc_memory import (
    CudaIpcMemory,
    FlatTarget,
    IpcHandle,
    IpcMemory,
    copy_into,
    layout_of,
    word_sum,
)
from asyncrl.weights._receiver import StagedReceiver
from asyncrl.weights._staging import check_publish, check_receiver_id, unpack_bucket
from asyncrl.weights.base import (
    Bucket,
    WeightBroadcaster,
    WeightMode,
    WeightSyncError,
    WeightUpdate,
    plan_buckets,
    tensor_specs,
)
from asyncrl.weights.protocol import Manifest

__all__ = [
    "CudaIpcMemory",
    "CudaIpcWeightBroadcaster",
    "CudaIpcWeightReceiver",
    "FlatTarget",
    "IpcHandle",
    "IpcMemory",
    "check_ipc_bind",
    "copy_into",
    "word_sum",
]

logger = logging.getLogger(__name__)

HEADER = 64
"""Bytes before a slot's data: int64 publish, version, checksum, nbytes, then zeros."""
TICK_S = 0.002
MAX_DRAIN = 64
WANT_INTERVAL_S = 1.0
MAX_MESSAGE_BYTES = 16 << 20
BUCKET_BYTES = 1 << 62
"""One bucket for the whole version: a slot is one allocation, copied and verified at once."""

VERSION, WANT, RELEASE, COMMIT = "ci_version", "ci_want", "ci_release", "ci_commit"
RECEIVER_KINDS = frozenset({WANT, RELEASE, COMMIT})
BROADCASTER_KINDS = frozenset({VERSION})
_OPT_INT = (int, NoneType)
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    VERSION: {"version": _OPT_INT, "slots": list},  # + manifest fields, "slot", "publish" when version is set
    WANT: {"receiver_id": str, "have": _OPT_INT},
    RELEASE: {"receiver_id": str, "slot": int, "publish": int},
    COMMIT: {"receiver_id": str, "version": int},
}


def check_ipc_bind(bind: str) -> None:
    """CUDA IPC reaches only processes on this node: refuse a bind anyone off the node could connect to.

    Raises:
        ValueError: naming the fix.
    """
    if not is_loopback_bind(bind):
        raise ValueError(f"refusing to bind the cuda_ipc weight broadcaster to {bind!r}: CUDA IPC serves receivers on "
                         "this node only; bind ipc:// (the default) or loopback, and use weights.type 'nccl' or 'zmq' "
                         "for receivers on other machines")


def _padded(nbytes: int) -> int:
    return (nbytes + HEADER - 1) // HEADER * HEADER


def _views(buckets: list[Bucket], buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``buckets`` laid out back to back in ``buf`` after the header (empty ones on its device)."""
    out: dict[str, torch.Tensor] = {}
    offset = HEADER
    for b in buckets:
        for name, t in unpack_bucket(b, buf[offset : offset + b.nbytes]).items():
            out[name] = t if t.numel() else torch.empty(t.shape, dtype=t.dtype, device=buf.device)
        offset += b.nbytes
    return out


# -- broadcaster -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Slot:
    id: int
    buf: torch.Tensor
    event: Any
    wire: dict[str, Any]
    """``{id, handle, event, nbytes}`` as receivers get it."""
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    holders: set[str] = field(default_factory=set)
    """Receivers sent this slot's current version that have not released it."""
    publish: int = 0


def _cleanup(directory: OwnedDir | None) -> None:
    if directory is not None:
        directory.close()


class CudaIpcWeightBroadcaster(WeightBroadcaster):
    """Trainer end: writes each version into one of two persistent GPU slots and tells receivers where it is.

    Args:
        bind: ZeroMQ endpoint for receivers (default: ``ipc://`` in a fresh private directory); loopback only.
        device: the GPU of the slots (default: the current one); ignored with ``memory``.
        slot_wait_s: how long a publish waits for receivers to release the slot it reuses before it writes into a
            fresh slot instead.
        memory: the device operations (default :class:`CudaIpcMemory` on ``device``).
        bucket_bytes: accepted for compatibility with the other backends; a slot is one bucket (one copy, one
            checksum) whatever it says.
    """

    def __init__(self, bind: str | None = None, *, device: int | str | None = None, slot_wait_s: float = 1.0,
                 memory: IpcMemory | None = None, bucket_bytes: int | None = None):
        if slot_wait_s < 0:
            raise ValueError(f"{slot_wait_s=} must be >= 0")
        WeightBroadcaster.__init__(self)
        self._memory = memory if memory is not None else CudaIpcMemory(device)
        # owner-locked (asyncrl._owned_dir): a SIGKILLed broadcaster's directory goes when the next one starts
        self._dir = make_owned_dir("asyncrl-cuda-ipc-")[0] if bind is None else None
        bind = f"ipc://{self._dir.path}/weights.sock" if bind is None else bind
        check_ipc_bind(bind)
        self.slot_wait_s = slot_wait_s
        self._lock = threading.Condition()
        self._stream = self._memory.stream()
        self._layout: tuple[list[str], list[tuple[torch.dtype, torch.Size]]] | None = None
        self._buckets: list[Bucket] = []
        self._buckets_wire: list[dict[str, Any]] = []
        self._slots: list[_Slot] = []
        self._next = 0
        self._ids = 0
        self._publish_seq = 0
        """Publishes so far: each slot names the publish it holds."""
        self._latest: dict[str, Any] | None = None
        self._peers: dict[str, bytes] = {}
        self._committed: dict[str, int] = {}
        self._outbox: queue.SimpleQueue[tuple[str | None, dict[str, Any]]] = queue.SimpleQueue()
        self._counters: collections.Counter[str] = collections.Counter()
        self._io = IOThread(self, "asyncrl-cuda-ipc-broadcaster")
        self._sock = self._io.ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(bind)
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._waker = Waker(self._io.ctx, "cuda-ipc")
        self._wake_pull = self._waker.pull()
        self._finalizer = weakref.finalize(self, _cleanup, self._dir)
        self._io.start(self._run)

    @property
    def address(self) -> str:
        return self._address

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocates the slots for ``tensors``' layout now (their dtypes and shapes), so receivers that start before
        the first publish open them at start-up instead of on the first version."""
        with self._lock:
            self._ensure_layout(tensors)
            self._latest = {"version": None, "slots": [s.wire for s in self._slots]}
        self._post(self._latest)

    def _publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, mode: WeightMode,
                 lora_config: dict[str, Any] | None, incarnation: str,
                 plan: Sequence[Bucket] | None = None) -> dict[str, Any]:
        if plan is not None:
            raise ValueError("the cuda_ipc backend packs versions its own way and cannot re-serve a bucket plan; "
                             "publish without plan=")
        t0 = time.perf_counter()
        with self._lock:
            if not self._same_layout(tensors):  # the full check walks every tensor: once per layout
                check_publish(tensors, version, self._last_version, mode, lora_config)
                self._ensure_layout(tensors)
            else:
                check_publish({}, version, self._last_version, mode, lora_config)
            slot = self._claim()
            t1 = time.perf_counter()
            self._publish_seq += 1
            slot.publish = self._publish_seq
            self._write(slot, tensors, version)
            nbytes = sum(b.nbytes for b in self._buckets)
            self._latest = {"version": version, "incarnation": incarnation, "mode": mode, "lora_config": lora_config,
                            "nbytes": nbytes, "buckets": self._buckets_wire, "slot": slot.id, "publish": slot.publish,
                            "slots": [s.wire for s in self._slots]}  # Manifest.to_wire's fields, buckets made once
            self._last_version = version
            self._counters["versions_published"] += 1
            body = self._latest
        self._post(body)
        return {"bytes": nbytes, "buckets": len(self._buckets), "slot_wait_s": t1 - t0}

    def _post(self, body: dict[str, Any]) -> None:
        """Queues a VERSION for every receiver and wakes the I/O thread, so it goes out now, not on its next tick."""
        self._outbox.put((None, body))
        self._waker.wake()

    @staticmethod
    def _layout_of(tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[tuple[torch.dtype, torch.Size]]]:
        specs = tensor_specs(tensors)
        return list(specs), [(t.dtype, t.shape) for t in specs.values()]

    def _same_layout(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self._layout is not None and self._layout_of(tensors) == self._layout

    def _ensure_layout(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """(Under the lock.) New slots for a new layout (names, dtypes, shapes); receivers keep the old ones open."""
        layout = self._layout_of(tensors)
        if layout == self._layout:
            return
        self._buckets = plan_buckets(tensors, BUCKET_BYTES)
        self._buckets_wire = [b.to_wire() for b in self._buckets]
        self._layout = layout
        self._slots = [self._new_slot(), self._new_slot()]
        self._next = 0

    def _new_slot(self) -> _Slot:
        nbytes = sum(b.nbytes for b in self._buckets)
        buf = self._memory.alloc(HEADER + _padded(nbytes))
        event, event_handle = self._memory.new_event()
        self._ids += 1
        self._counters["slots_allocated"] += 1
        slot = _Slot(self._ids, buf, event, {"id": self._ids, "handle": self._memory.export(buf),
                                             "event": event_handle, "nbytes": buf.numel()})
        slot.views = _views(self._buckets, buf)
        return slot

    def _claim(self) -> _Slot:
        """(Under the lock.) The slot for the next version once no receiver holds it (or a fresh one after
        ``slot_wait_s``)."""
        k = self._next
        self._next ^= 1
        slot = self._slots[k]
        if slot.holders:
            self._counters["slot_waits"] += 1
            t0 = time.monotonic()
            self._lock.wait_for(lambda: not slot.holders, timeout=self.slot_wait_s)
            self._counters["slot_wait_s"] += time.monotonic() - t0
            if slot.holders:
                self._counters["slots_replaced"] += 1
                logger.warning("weight broadcaster: slot %d still held by %s after slot_wait_s=%s; writing into a "
                               "fresh slot", slot.id, sorted(slot.holders), self.slot_wait_s)
                slot = self._slots[k] = self._new_slot()
        return slot

    def _write(self, slot: _Slot, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Enqueues the copies, the checksum and the event on the side stream; the trainer's stream waits for them."""
        mem, stream = self._memory, self._stream
        mem.after_current(stream)  # the parameters as the trainer's last step left them
        streamed = hasattr(tensors, "specs")  # a PolicyState gathers on access: one tensor at a time
        with mem.on(stream), torch.no_grad():
            names = list(slot.views)
            if streamed:
                for n in names:
                    src = tensors[n].detach()
                    slot.views[n].copy_(src, non_blocking=True)
                    if src.is_cuda:  # gathered for this copy and freed next: not reused before the side stream read it
                        src.record_stream(stream)
            elif names:
                torch._foreach_copy_(list(slot.views.values()), [tensors[n] for n in names], non_blocking=True)
            header = slot.buf[:HEADER].view(torch.int64)
            header[0].fill_(slot.publish)
            header[1].fill_(version)
            header[3].fill_(slot.buf.numel() - HEADER)
            header[2].copy_(word_sum(slot.buf[HEADER:]))
            mem.record(slot.event, stream)
        mem.current_after(stream)

    def committed(self) -> dict[str, int]:
        with self._lock:
            return dict(self._committed)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counters, "last_version": self._last_version, "receivers": sorted(self._peers),
                    "slots": [s.id for s in self._slots], "holders": {s.id: sorted(s.holders) for s in self._slots}}

    def close(self) -> None:
        self._io.close(before_join=self._waker.close)
        with self._lock:
            self._slots.clear()
        self._finalizer()

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        sock, wake = self._sock, self._wake_pull
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self._io.stop.is_set():
                ready = dict(poller.poll(int(TICK_S * 1000)))
                if sock in ready:
                    drain(sock, self._handle, MAX_DRAIN)
                if wake in ready:
                    drain(wake, lambda frames: None, MAX_DRAIN)
                while True:
                    try:
                        to, body = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    for receiver_id in ([to] if to is not None else list(self._peers)):
                        self._send_version(receiver_id, body)
        finally:
            sock.close(linger=0)
            wake.close(linger=0)

    def _send_version(self, receiver_id: str, body: dict[str, Any]) -> None:
        identity = self._peers.get(receiver_id)
        if identity is None:
            return
        with self._lock:
            slot = next((s for s in self._slots if s.id == body.get("slot") and s.publish == body.get("publish")),
                        None)
            if body.get("version") is not None and slot is None:
                return  # superseded by a newer publish into that slot before it went out: the newer one follows
            if slot is not None:
                slot.holders.add(receiver_id)
        try:
            self._sock.send_multipart([identity, *encode(VERSION, body)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone (ROUTER_MANDATORY) or its queue is full: it asks again with WANT
            self._counters["send_failed"] += 1
            logger.info("weight broadcaster: cannot send version to %s: %s", receiver_id, e)
            with self._lock:
                if slot is not None:
                    slot.holders.discard(receiver_id)
                    self._lock.notify_all()
                if e.errno == zmq.EHOSTUNREACH:
                    self._peers.pop(receiver_id, None)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            kind, body = decode(frames[1:], max_message_bytes=1 << 16)
            check_fields(kind, body, RECEIVER_KINDS, _REQUIRED, "cuda_ipc weight message")
            receiver_id = check_receiver_id(body["receiver_id"])
        except (DecodeError, ValueError) as e:  # bad input from a peer: counted, nothing else changes
            self._counters["bad_messages"] += 1
            logger.warning("weight broadcaster: bad message: %s", e)
            return
        if self._peers.get(receiver_id, identity) != identity and kind != WANT:
            self._counters["bad_messages"] += 1  # another connection speaking for this receiver
            return
        if kind == WANT:
            self._peers[receiver_id] = identity
            with self._lock:
                latest = self._latest
                fresh = latest is not None and (latest.get("version") is None or body["have"] != latest["version"]
                                                or body.get("have_incarnation", "") != latest.get("incarnation", ""))
            if fresh:
                self._send_version(receiver_id, latest)
            elif latest is not None:
                self._send_version(receiver_id, {"version": None, "slots": latest["slots"]})
            else:
                self._send_version(receiver_id, {"version": None, "slots": []})
        elif kind == RELEASE:
            with self._lock:
                for s in self._slots:
                    if s.id == body["slot"] and s.publish == body["publish"]:
                        s.holders.discard(receiver_id)
                self._lock.notify_all()
        elif kind == COMMIT:
            with self._lock:
                self._committed[receiver_id] = body["version"]


# -- receiver --------------------------------------------------------------------------------------
class CudaIpcWeightReceiver(StagedReceiver):
    """Worker end: opens the broadcaster's slots once and stages each verified version as views into its slot.

    Args:
        address: the broadcaster's :attr:`~CudaIpcWeightBroadcaster.address`.
        receiver_id: unique name of this worker.
        device: this process's GPU for the side stream (default: the current one); ignored with ``memory``.
        timeout_s: how long :meth:`start` waits for the broadcaster's first reply.
        memory: the device operations (default :class:`CudaIpcMemory`).

    Memory: none of the weights; the staged update's tensors are views into the broadcaster's slot, valid while the
    update is held (see ``StagingArea``); the engine must not write into them.
    """

    uses_zmq = True

    def __init__(self, address: str, *, receiver_id: str, device: int | str | None = None, timeout_s: float = 30.0,
                 memory: IpcMemory | None = None):
        if timeout_s <= 0:
            raise ValueError(f"{timeout_s=} must be > 0")
        super().__init__(address, receiver_id=receiver_id)
        self.timeout_s = timeout_s
        self._memory = memory if memory is not None else CudaIpcMemory(device)
        self._heard = threading.Event()
        self._open_error: str | None = None
        self._commits: collections.deque[int] = collections.deque()
        self._releases: collections.deque[tuple[int, int, Any]] = collections.deque()
        # I/O thread only:
        self._streams: dict[torch.device, Any] = {}
        self._parsed: tuple[list[Any], list[Bucket], tuple] | None = None
        """The last layout's bucket wire, its parse and its tensor layout (a version of the same layout skips both)."""
        self._views: dict[int, tuple[list[Bucket], dict[str, torch.Tensor]]] = {}
        self._open: dict[int, tuple[torch.Tensor, Any]] = {}
        self._next_want = 0.0

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._heard.wait(0.05) and time.monotonic() < deadline:
            if self._staging.stats()["error"] is not None or self._open_error is not None:
                break
        if not self._heard.is_set():
            error = self._staging.stats()["error"] or self._open_error
            if error is not None:  # the I/O thread died, or the broadcaster's slots cannot be opened here
                self.close()
                raise WeightSyncError(f"receiver {self.receiver_id}: cannot start: {error}")
            self.close()
            raise WeightSyncError(f"receiver {self.receiver_id}: no reply from the cuda_ipc weight broadcaster at "
                                  f"{self.address!r} within timeout_s={self.timeout_s}; check the address and that "
                                  "the trainer runs on this node")

    def _on_commit(self, version: int) -> None:
        self._commits.append(version)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["slots_open"] = len(self._open)
        return out

    # -- I/O thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                if sock.poll(int(TICK_S * 1000)):
                    drain(sock, lambda frames: self._handle(sock, frames), MAX_DRAIN)
                self._tick(sock, time.monotonic())
        finally:
            self._tick(sock, float("-inf"))
            sock.close(linger=200)

    def _send(self, sock: zmq.Socket, kind: str, body: dict[str, Any]) -> None:
        try:
            sock.send_multipart(encode(kind, {"receiver_id": self.receiver_id, **body}), zmq.NOBLOCK)
        except zmq.Again:  # WANT is retried; a lost RELEASE costs the broadcaster slot_wait_s
            self._staging.count(f"send_dropped_{kind}")

    def _tick(self, sock: zmq.Socket, now: float) -> None:
        while self._commits:
            self._send(sock, COMMIT, {"version": self._commits.popleft()})
        while self._releases and self._memory.done(self._releases[0][2]):
            slot, publish, _ = self._releases.popleft()
            self._send(sock, RELEASE, {"slot": slot, "publish": publish})
        if now >= self._next_want:
            self._next_want = now + WANT_INTERVAL_S
            self._send(sock, WANT, {"have": self._staging.newest(), "have_incarnation": self._staging.newest_incarnation()})

    def _release_later(self, slot: int, publish: int) -> None:
        """(Any thread: the staging area's release callback.) The slot goes back once the GPU work enqueued so far on
        this thread's streams (the engine's copy out of it) has run."""
        opened = self._open.get(slot)
        self._releases.append((slot, publish, self._memory.marker(() if opened is None else (opened[0].device,))))

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        body: Any = None
        try:
            kind, body = decode(frames, max_message_bytes=MAX_MESSAGE_BYTES)
            check_fields(kind, body, BROADCASTER_KINDS, _REQUIRED, "cuda_ipc weight message")
            self._open_slots(body["slots"])
            m = None if body["version"] is None else self._manifest(body)
            if m is not None and (type(body.get("slot")) is not int or type(body.get("publish")) is not int):
                raise DecodeError("VERSION without an int slot and publish")
        except (DecodeError, WeightSyncError) as e:  # bad input or a slot that cannot be opened: counted
            if isinstance(e, WeightSyncError):
                self._open_error = str(e)
            self._staging.count("bad_messages")
            version = body.get("version") if isinstance(body, dict) else None
            self._fail(version if type(version) is int else None, f"bad message from the broadcaster: {e}")
            return
        self._heard.set()
        if m is None:
            return
        slot, publish = body["slot"], body["publish"]
        if not (self._staging.is_newer(m.version, m.incarnation) and self._retry_due(m.version, time.monotonic())):
            self._release_later(slot, publish)
            return
        staged = False
        try:
            staged = self._verify_and_stage(m, slot, publish)
        finally:
            if not staged:
                self._release_later(slot, publish)

    def _manifest(self, body: dict[str, Any]) -> Manifest:
        """Parses a VERSION's manifest; the buckets (one entry per tensor: the slow part) only when the layout
        changed."""
        cached = self._parsed
        if cached is not None and body.get("buckets") == cached[0]:
            m = Manifest.from_wire({**body, "buckets": [], "nbytes": 0})
            if body.get("nbytes") != sum(b.nbytes for b in cached[1]):
                raise DecodeError(f"manifest: nbytes {body.get('nbytes')!r:.20} is not the sum of its buckets")
            m.buckets = cached[1]
            return m
        m = Manifest.from_wire(body)
        self._parsed = (body["buckets"], m.buckets, ())
        return m

    def _open_slots(self, slots: list[Any]) -> None:
        for item in slots:
            if not isinstance(item, dict) or type(item.get("id")) is not int or not isinstance(item.get("event"), bytes):
                raise DecodeError(f"malformed slot {item!r:.200}")
            if item["id"] in self._open:
                continue
            t0 = time.perf_counter()
            buf = self._memory.open(item["handle"])
            if buf.dim() != 1 or buf.dtype != torch.uint8 or buf.numel() != item.get("nbytes"):
                raise DecodeError(f"slot {item['id']}: opened {buf.dtype}{list(buf.shape)}, announced "
                                  f"{item.get('nbytes')!r:.20} bytes")
            self._open[item["id"]] = (buf, self._memory.open_event(item["event"], buf))
            self._staging.count("slots_opened")
            self._staging.set_info(last_open_s=time.perf_counter() - t0)
        live = {item["id"] for item in slots}
        for k in [k for k in self._open if k not in live]:
            del self._open[k]  # replaced by the broadcaster; views already staged keep the memory alive
            self._views.pop(k, None)

    def _verify_and_stage(self, m: Manifest, slot_id: int, publish: int) -> bool:
        started = time.perf_counter()
        if slot_id not in self._open:
            self._fail(m.version, f"version {m.version} is in slot {slot_id}, which the broadcaster never sent")
            return False
        buf, event = self._open[slot_id]
        if HEADER + m.nbytes > buf.numel():
            self._fail(m.version, f"version {m.version} ({m.nbytes} bytes) does not fit slot {slot_id} "
                                  f"({buf.numel()} bytes)")
            return False
        mem = self._memory
        stream = self._streams.get(buf.device)
        if stream is None:  # the slot's GPU runs the verification (its kernels run on that device's streams)
            stream = self._streams[buf.device] = mem.stream(buf.device)
        with mem.on(stream):
            mem.wait(event, stream)
            checked = torch.cat([buf[:HEADER].view(torch.int64)[:4], word_sum(buf[HEADER:]).view(1)])
            mem.synchronize(stream)
            held_publish, held_version, want, _, got_sum = checked.tolist()  # the one host sync per version
        if held_publish != publish or held_version != m.version:
            self._staging.count("abandoned")  # the slot already holds a later publish: that VERSION follows
            return False
        if got_sum != want:
            self._staging.count("checksum_mismatches")
            self._fail(m.version, f"checksum mismatch in slot {slot_id} for version {m.version}: got {got_sum:#x}, "
                                  f"the header says {want:#x}")
            return False
        cached = self._views.get(slot_id)
        if cached is None or cached[0] is not m.buckets:  # views of a slot are made once per layout
            cached = self._views[slot_id] = (m.buckets, _views(m.buckets, buf))
        tensors = dict(cached[1])
        flat = buf[HEADER : HEADER + m.nbytes]
        parsed = self._parsed
        if parsed is not None and parsed[1] is m.buckets and not parsed[2]:
            self._parsed = parsed = (parsed[0], parsed[1], layout_of(tensors, flat))
        self._staging.count("bytes_received", m.nbytes)
        meta = {"receiver_id": self.receiver_id, "slot": slot_id, "publish": publish, "flat": flat,
                "layout": parsed[2] if parsed is not None and parsed[1] is m.buckets else layout_of(tensors, flat),
                "staged_at": time.monotonic(), "transfer_s": time.perf_counter() - started}
        update = WeightUpdate(version=m.version, mode=m.mode, tensors=tensors, lora_config=m.lora_config,
                              metadata=meta, incarnation=m.incarnation)
        self._stage(update, release=lambda: self._release_later(slot_id, publish))
        return True
