"""Shared-memory backend of weight sync (one machine): both ends of its segment protocol.

The broadcaster and its receivers share one directory (by default a fresh one under ``/dev/shm``, so
files live in RAM)::

    {token}-slot{0,1}-{gen}.seg   two persistent segments per weight layout (double buffering): a header
                                  [magic, publish, buckets, written, state, progress, checksum per bucket]
                                  then the buckets back to back from ``data_offset``
    latest.json                   the newest version: {format, publish, segment, data_offset, version,
                                  incarnation, mode, lora_config, nbytes, buckets}; replaced atomically
    committed-{receiver}.json     {receiver_id, version, pid, time}: phase two, written by each receiver

Segments are created, allocated (``posix_fallocate``) and mapped with their page tables populated once per
weight layout, and reused by every later version of that layout: no page faults on the way. Versions
alternate between the two slots, so a receiver still reading (or applying) version ``v`` is never
overwritten by ``v + 1``. Holds are ``flock`` locks, which the kernel drops when a receiver dies: a
receiver takes a shared lock on the slot of the version it reads and keeps it until that version is
committed or superseded (:class:`~asyncrl.weights._staging.StagingArea`'s holds); the broadcaster takes
the exclusive lock before it reuses a slot. A slot still held after ``slot_wait_s`` (a stuck receiver) is
not waited for further: the broadcaster unlinks that segment and writes into a fresh one (counted in
``stats()["slots_replaced"]``); the stuck receiver keeps its intact mapping of the old one.

Pipelining: ``latest.json`` is written before the first bucket. The broadcaster then copies bucket after
bucket into the slot, each copy fused with the bucket's checksum (``asyncrl.weights._checksum``), and
publishes each bucket by storing its checksum and then the header's ``written`` count; a receiver
verifies bucket ``i`` in place while the broadcaster writes ``i + 1``, and stages views into the segment:
the engine loads from them (HF: ``param.copy_(view)``), with no copy in between. With the engine's shadow
weights attached (``weights.shadow``, :mod:`asyncrl.weights.shadow`) the receiver instead copies bucket ``i``
into the shadow with the verification fused into that copy, while ``i + 1`` is written, drops its hold on the
slot once the last bucket is in, and stages the shadow: the engine swaps it in at commit, with no copy on the
critical path. Inside a bucket it trails the broadcaster by a piece: the broadcaster stores the header's
``progress`` (MiB of the data area that are final) after every 1 MiB it writes, and the receiver copies up to it,
so a bucket as large as an embedding is not copied only after it is complete. A shadow still held by an earlier version (staged or being applied) is never written: that
version is staged as views instead (counted ``shadow_busy``). (The two stores rely on
the store order of x86 and of the Linux memory model for shared mappings between processes on one
machine; ARM would need a fence.)

Who blocks on what: the trainer thread blocks in :meth:`ShmWeightBroadcaster.publish` while it waits for
the slot (at most ``slot_wait_s``) and writes the version. Each receiver's I/O thread stats
``latest.json`` every ``poll_s`` and, during a transfer, polls the header's ``written`` every ``SPIN_S``; a
newer ``latest.json`` between two buckets abandons the older version. The worker's thread blocks only in
:meth:`ShmWeightReceiver.wait`. A vanished, truncated, failed or corrupted segment is a counted, logged
failure: nothing is staged and the committed version stays; a torn version is never staged.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch

from asyncrl._owned_dir import OwnedDir, Swept, make_owned_dir
from asyncrl.codec import DecodeError
from asyncrl.weights._checksum import BucketScatter, checksum, fill_bucket
from asyncrl.weights._receiver import StagedReceiver
from asyncrl.weights._staging import check_filled, check_receiver_id, plan_publish, unpack_bucket
from asyncrl.weights.base import Bucket, WeightBroadcaster, WeightMode, WeightSyncError, WeightUpdate
from asyncrl.weights.protocol import Manifest

__all__ = ["ShmWeightBroadcaster", "ShmWeightReceiver"]

logger = logging.getLogger(__name__)

FORMAT = 2
LATEST = "latest.json"
MAGIC = 0x4745_5357_4C52_5341  # b"ASRLWSEG", little-endian
_HEADER = struct.Struct("<QQIIII")  # magic, publish, buckets, written, state, progress (MiB of data final)
_CHECKSUM = struct.Struct("<Q")
EMPTY, WRITING, COMPLETE, FAILED = 0, 1, 2, 3
PAGE = 4096
SPIN_S = 0.0002
"""How often a receiver looks at the header's ``written`` count while it waits for the next bucket."""
LOCK_POLL_S = 0.0005


PREFIX = "asyncrl-weights-"


def _default_directory() -> tuple[OwnedDir, Swept]:
    """A fresh owner-locked directory under ``/dev/shm`` (else the temp dir), after sweeping dead runs' ones."""
    shm = "/dev/shm"
    return make_owned_dir(PREFIX, shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _data_offset(n_buckets: int) -> int:
    return (_HEADER.size + _CHECKSUM.size * n_buckets + PAGE - 1) // PAGE * PAGE


def _lock(fd: int, how: int, timeout: float) -> bool:
    """``flock(fd, how)`` within ``timeout`` seconds (polling: a blocking flock cannot time out)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_S)


def _buffer(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # a receiver's mapping is read-only on purpose: only the broadcaster writes
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)


class _Segment:
    """A broadcaster's slot: a file in the shared directory, allocated and mapped once."""

    def __init__(self, path: Path, layout: tuple[int, ...]):
        self.path, self.layout = path, layout
        self.data_offset = _data_offset(len(layout))
        self.size = self.data_offset + max(sum(layout), 1)
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, self.size)  # every page now (ENOSPC here, not SIGBUS later)
            self.mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise
        self.buf = _buffer(self.mm)
        _HEADER.pack_into(self.mm, 0, MAGIC, 0, len(layout), 0, EMPTY, 0)

    def bucket(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[self.data_offset + offset : self.data_offset + offset + nbytes]

    def begin(self, publish: int) -> None:
        """(Holding the exclusive lock.) Claims the slot for ``publish``: receivers of its old content see it."""
        _HEADER.pack_into(self.mm, 0, MAGIC, publish, len(self.layout), 0, WRITING, 0)

    def written(self, index: int, value: int) -> None:
        _CHECKSUM.pack_into(self.mm, _HEADER.size + _CHECKSUM.size * index, value)
        struct.pack_into("<I", self.mm, 20, index + 1)  # after the checksum: a reader sees both or neither

    def progress(self, nbytes: int) -> None:
        """The first ``nbytes`` of the data area are final (after the bytes: a reader that sees it sees them)."""
        struct.pack_into("<I", self.mm, 28, nbytes >> 20)

    def finish(self, state: int) -> None:
        struct.pack_into("<I", self.mm, 24, state)

    def vanished(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)  # the mapping (and receivers' mappings) stay valid until dropped


def _cleanup(directory: str, owned: OwnedDir | None, segments: list[_Segment]) -> None:
    for seg in segments:
        try:
            seg.close()
        except OSError:
            pass
    segments.clear()
    if owned is not None:
        owned.close()
    else:
        Path(directory, LATEST).unlink(missing_ok=True)


class ShmWeightBroadcaster(WeightBroadcaster):
    """Trainer end: writes each version into one of two persistent shared-memory segments.

    Args:
        directory: the shared directory (created if missing). Default: a fresh directory under
            ``/dev/shm`` (else the system temp dir), removed on :meth:`close`; a given directory
            keeps everything but the files this broadcaster wrote. The default directory is owner-locked
            (:mod:`asyncrl._owned_dir`): one left by a SIGKILLed broadcaster is removed when the next one
            starts (counted in ``stats()["stale_dirs_removed"]`` / ``["stale_bytes_removed"]``).
        bucket_bytes: the bucket size (checksum and pipelining granularity; a larger tensor gets its own bucket).
        slot_wait_s: how long a publish waits for receivers to release the slot it reuses before it
            replaces that slot's segment with a fresh one.
        keep_versions: accepted for compatibility with the zmq backend; two slots are always kept.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, bucket_bytes: int = 64 << 20,
                 slot_wait_s: float = 1.0, keep_versions: int = 2):
        if bucket_bytes <= 0 or slot_wait_s < 0 or keep_versions < 1:
            raise ValueError(f"{bucket_bytes=} must be > 0, {slot_wait_s=} >= 0 and {keep_versions=} >= 1")
        WeightBroadcaster.__init__(self)
        owned, swept = _default_directory() if directory is None else (None, Swept())
        self.directory = owned.path if owned is not None else Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = bucket_bytes
        self.slot_wait_s = slot_wait_s
        self._token = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._publish_seq = 0
        """Publishes so far: each segment header names the publish it holds."""
        self._generation = 0
        self._layout: tuple[int, ...] | None = None
        self._slots: list[_Segment] = []
        self._next_slot = 0
        self._progress: Any = None
        """(Under ``_lock``, while publishing.) Stores the header's progress for the bucket being written."""
        self._counters: dict[str, float] = {"versions_published": 0, "segments_created": 0, "slot_waits": 0,
                                            "slot_wait_s": 0.0, "slots_replaced": 0,
                                            "stale_dirs_removed": len(swept.removed),
                                            "stale_bytes_removed": swept.removed_bytes}
        self._finalizer = weakref.finalize(self, _cleanup, str(self.directory), owned, self._slots)

    @property
    def address(self) -> str:
        return str(self.directory)

    def _publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, mode: WeightMode,
                 lora_config: dict[str, Any] | None, incarnation: str,
                 plan: Sequence[Bucket] | None = None) -> dict[str, Any]:
        with self._lock:
            t0 = time.perf_counter()
            buckets = plan_publish(tensors, version, self._last_version, mode, lora_config, self.bucket_bytes, plan)
            manifest = Manifest(version=version, incarnation=incarnation, mode=mode, lora_config=lora_config,
                                buckets=buckets)
            body = {"format": FORMAT, **manifest.to_wire()}
            orjson.dumps(body)  # TypeError here (a lora_config JSON refuses), before anything is visible
            seg = self._claim(tuple(b.nbytes for b in buckets))
            t1 = time.perf_counter()
            self._publish_seq += 1
            seg.begin(self._publish_seq)
            fcntl.flock(seg.fd, fcntl.LOCK_UN)  # readers of this publish may lock it from now on
            body.update(publish=self._publish_seq, segment=seg.path.name, data_offset=seg.data_offset)
            _write_atomic(self.directory / LATEST, orjson.dumps(body))
            try:
                offset = 0
                for b in buckets:
                    self._progress = lambda n, o=offset: seg.progress(o + n)
                    checksum = self._fill(b, tensors, seg.bucket(offset, b.nbytes))
                    seg.written(b.index, check_filled(b, checksum, plan is not None))
                    offset += b.nbytes
            except BaseException:
                seg.finish(FAILED)  # receivers fail this version; nothing torn is staged
                raise
            seg.finish(COMPLETE)
            self._next_slot ^= 1
            self._last_version = version
            self._counters["versions_published"] += 1
        return {"bytes": manifest.nbytes, "buckets": len(buckets), "slot_wait_s": t1 - t0}

    def _fill(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> int:
        """Copies one bucket into the slot and returns its checksum (the per-bucket write; tests that corrupt
        a bucket after its checksum override this)."""
        return fill_bucket(bucket, tensors, out, self._progress)

    def _claim(self, layout: tuple[int, ...]) -> _Segment:
        """(Under ``_lock``.) The slot for the next version, exclusively locked: no receiver reads it."""
        if layout != self._layout:  # a new weight layout: new segments (receivers keep their old mappings)
            for seg in self._slots:
                seg.close()
            self._slots[:] = [self._new_segment(k, layout) for k in range(2)]
            self._layout, self._next_slot = layout, 0
        k = self._next_slot
        seg = self._slots[k]
        if seg.vanished():  # someone removed the file: receivers could not open it
            seg.close()
            seg = self._slots[k] = self._new_segment(k, layout)
        t0 = time.monotonic()
        if not _lock(seg.fd, fcntl.LOCK_EX, 0.0):
            self._counters["slot_waits"] += 1
            locked = _lock(seg.fd, fcntl.LOCK_EX, self.slot_wait_s)
            self._counters["slot_wait_s"] += time.monotonic() - t0
            if not locked:  # a receiver holds it past slot_wait_s (stuck, or stopped): do not overwrite it
                self._counters["slots_replaced"] += 1
                logger.warning("weight broadcaster: slot %d (%s) still held by a receiver after slot_wait_s=%s; "
                               "writing into a fresh segment", k, seg.path.name, self.slot_wait_s)
                seg.close()
                seg = self._slots[k] = self._new_segment(k, layout)
                fcntl.flock(seg.fd, fcntl.LOCK_EX)
        return seg

    def _new_segment(self, slot: int, layout: tuple[int, ...]) -> _Segment:
        self._generation += 1
        self._counters["segments_created"] += 1
        return _Segment(self.directory / f"{self._token}-slot{slot}-{self._generation}.seg", layout)

    def committed(self) -> dict[str, int]:
        out = {}
        for path in self.directory.glob("committed-*.json"):
            try:
                record = orjson.loads(path.read_bytes())
                out[check_receiver_id(record["receiver_id"])] = int(record["version"])
            except (OSError, ValueError, KeyError, TypeError) as e:  # a receiver's file, not ours: skip it
                with self._lock:
                    self._counters["bad_commit_files"] = self._counters.get("bad_commit_files", 0) + 1
                logger.debug("skipping unreadable %s: %s", path, e)
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counters, "last_version": self._last_version, "directory": str(self.directory),
                    "segments": [seg.path.name for seg in self._slots]}

    def close(self) -> None:
        with self._lock:
            self._finalizer()


@dataclass(slots=True)
class _Mapping:
    """A receiver's read-only mapping of one segment file, kept across versions (page tables populated once)."""

    path: Path
    inode: int
    mm: mmap.mmap
    buf: torch.Tensor

    def stale(self) -> bool:
        """The file was removed or replaced: nothing new will be published into this mapping."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True


class ShmWeightReceiver(StagedReceiver):
    """Worker end: an I/O thread that watches ``latest.json`` and stages the newest version in place.

    Args:
        directory: the broadcaster's :attr:`~ShmWeightBroadcaster.address`.
        receiver_id: unique name of this worker; names its ``committed-*.json`` file.
        poll_s: how often ``latest.json`` is stat'ed.
        timeout_s: how long a transfer may wait for the broadcaster's next bucket before it fails.

    Memory: no copy of the weights; the staged update's tensors are read-only views into the segments
    (writing into one faults). They stay valid while the update is held (see ``StagingArea``). With
    :meth:`attach_shadow`, a ``full`` version matching the shadow's layout is staged over the shadow instead.
    """

    supports_shadow = True

    def __init__(self, directory: str | os.PathLike, *, receiver_id: str, poll_s: float = 0.002,
                 timeout_s: float = 30.0):
        if poll_s <= 0 or timeout_s <= 0:
            raise ValueError(f"{poll_s=} and {timeout_s=} must be > 0")
        super().__init__(str(directory), receiver_id=receiver_id)
        self.directory = Path(directory)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        # I/O thread only:
        self._last_key: tuple[int, int, int] | None = None
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._shadow_refused: str | None = None

    # -- worker thread -------------------------------------------------------------------------
    def _check_start(self) -> None:
        if not self.directory.is_dir():
            raise WeightSyncError(f"receiver {self.receiver_id}: weight directory {str(self.directory)!r} does not "
                                  "exist; pass the broadcaster's address")

    def _on_commit(self, version: int) -> None:
        record = {"receiver_id": self.receiver_id, "version": version, "pid": os.getpid(), "time": time.time()}
        try:
            _write_atomic(self.directory / f"committed-{self.receiver_id}.json", orjson.dumps(record))
        except OSError as e:  # the engine runs the version either way; only the report is lost
            self._staging.count("commit_report_failed")
            logger.warning("receiver %s: cannot record commit of version %d: %s", self.receiver_id, version, e)

    def close(self) -> None:
        super().close()
        self._maps.clear()  # each mapping goes with the last view into it

    # -- I/O thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._check_once(time.monotonic())

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.directory / LATEST)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _check_once(self, now: float) -> None:
        key = self._stat_key()
        retry = self._failed_version is not None and now >= self._retry_after
        if key is None or (key == self._last_key and not retry):
            return
        self._last_key = key
        m = self._read_manifest(now)
        if m is not None and self._staging.is_newer(m["manifest"].version, m["manifest"].incarnation):
            if self._retry_due(m["manifest"].version, now):
                self._fetch(m)

    def _read_manifest(self, now: float) -> dict[str, Any] | None:
        try:
            body = orjson.loads((self.directory / LATEST).read_bytes())
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise DecodeError(f"{LATEST} is not format {FORMAT}")
            segment, publish, data_offset = body.get("segment"), body.get("publish"), body.get("data_offset")
            if not isinstance(segment, str) or "/" in segment or not segment.endswith(".seg"):
                raise DecodeError(f"{LATEST}: bad segment name {segment!r:.60}")
            if type(publish) is not int or type(data_offset) is not int or data_offset < 0:
                raise DecodeError(f"{LATEST}: bad publish {publish!r:.20} or data_offset {data_offset!r:.20}")
            return {"manifest": Manifest.from_wire(body), "segment": segment, "publish": publish,
                    "data_offset": data_offset}
        except FileNotFoundError:  # replaced between stat and read: the next tick sees the new one
            self._last_key = None
            return None
        except (orjson.JSONDecodeError, DecodeError) as e:
            self._fail(None, f"unreadable {LATEST}: {e}", now)
            return None

    def _newer_than(self, key: tuple[int, int, int] | None) -> bool:
        now_key = self._stat_key()
        return now_key is not None and now_key != key

    def _map(self, fd: int, path: Path) -> _Mapping:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        m = self._maps.get(key)
        if m is None:
            for k in [k for k, old in self._maps.items() if old.stale()]:
                del self._maps[k]  # a replaced segment: its memory goes with the last view into it
            # mmap keeps a dup of the descriptor it maps, and a dup shares the open file's flock: map through a
            # descriptor of its own, or the mapping would hold this transfer's shared lock for as long as it lives
            own = os.open(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path, os.O_RDONLY)
            try:
                if os.fstat(own).st_ino != st.st_ino:
                    raise OSError(f"{path} was replaced while it was being opened")
                mm = mmap.mmap(own, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            finally:
                os.close(own)
            m = self._maps[key] = _Mapping(path, st.st_ino, mm, _buffer(mm))
        return m

    def _fetch(self, info: dict[str, Any]) -> None:
        m: Manifest = info["manifest"]
        version, path, started, key = m.version, self.directory / info["segment"], time.monotonic(), self._last_key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._fail(version, f"segment {path} vanished before it could be read")
            return
        staged = False
        try:
            if not _lock(fd, fcntl.LOCK_SH, 1.0):  # the broadcaster holds it only while it claims the slot
                self._fail(version, f"segment {path} stayed locked for 1 s")
                return
            try:
                mapping = self._map(fd, path)
            except (OSError, ValueError) as e:  # an empty or unmappable file: not a segment being written
                self._fail(version, f"cannot map segment {path}: {e}")
                return
            if (reason := self._check_header(mapping, info)) is not None:
                if reason == "superseded":
                    self._staging.count("abandoned")
                    self._last_key = None
                else:
                    self._fail(version, reason)
                return
            shadow = self._shadow_for(m)
            filling = shadow is not None
            try:
                if not self._read_buckets(mapping, info, key, shadow):
                    return
                if shadow is not None:
                    fill, release = self._shadow.finish()
                    filling = False
                    staged = True  # _stage_shadow closes fd first: the engine never reads the segment
                    self._stage_shadow(info, shadow, fill, release, started, fd)
                    return
            finally:
                if filling:
                    self._shadow.abort()  # failed, abandoned or stopped: nothing of this fill is staged
            tensors: dict[str, torch.Tensor] = {}
            offset = info["data_offset"]
            for b in m.buckets:
                tensors.update(unpack_bucket(b, mapping.buf[offset : offset + b.nbytes]))
                offset += b.nbytes
            meta = {"receiver_id": self.receiver_id, "buckets": len(m.buckets), "staged_at": time.monotonic(),
                    "transfer_s": time.monotonic() - started, "segment": info["segment"],
                    "segment_path": str(path), "publish": info["publish"]}  # vLLM's worker maps it (_vllm_transfer)
            self._stage(WeightUpdate(version=version, mode=m.mode, tensors=tensors, lora_config=m.lora_config,
                                     metadata=meta, incarnation=m.incarnation), release=lambda: os.close(fd))
            staged = True
        finally:
            if not staged:
                os.close(fd)  # drops the shared lock

    def _shadow_for(self, m: Manifest) -> dict[str, torch.Tensor] | None:
        """The attached shadow's tensors for this version (now FILLING), or None: views are staged instead."""
        if self._shadow is None or m.mode != "full":
            return None  # lora: adapters are small, the engine loads them from the views
        reason = self._shadow.layout_mismatch(s for b in m.buckets for s in b.slots)
        if reason is not None:
            self._staging.count("shadow_mismatch")
            if reason != self._shadow_refused:  # once per reason, not once per version
                logger.warning("receiver %s: version %d does not fit the engine's shadow weights (%s); staging views",
                               self.receiver_id, m.version, reason)
                self._shadow_refused = reason
                self._staging.set_info(shadow_refused=reason)
            return None
        tensors = self._shadow.acquire()
        if tensors is None:  # still held by an earlier version (staged, or the engine is applying it)
            self._staging.count("shadow_busy")
        return tensors

    def _stage_shadow(self, info: dict[str, Any], shadow: dict[str, torch.Tensor], fill: int, release: Any,
                      started: float, fd: int) -> None:
        """Stages the filled, verified shadow. The slot's hold is dropped first: nothing reads the segment again."""
        m: Manifest = info["manifest"]
        os.close(fd)
        tensors = {s.name: shadow[s.name] for b in m.buckets for s in b.slots}
        meta = {"receiver_id": self.receiver_id, "buckets": len(m.buckets), "staged_at": time.monotonic(),
                "transfer_s": time.monotonic() - started, "segment": info["segment"], "publish": info["publish"],
                "shadow": self._shadow, "shadow_fill": fill}
        self._staging.count("versions_via_shadow")
        self._stage(WeightUpdate(version=m.version, mode=m.mode, tensors=tensors, lora_config=m.lora_config,
                                 metadata=meta, incarnation=m.incarnation), release=release)

    def _check_header(self, mapping: _Mapping, info: dict[str, Any]) -> str | None:
        m: Manifest = info["manifest"]
        if len(mapping.mm) < _HEADER.size:
            return f"segment {info['segment']} is {len(mapping.mm)} bytes, too short for its header"
        magic, publish, n, _, state, _ = _HEADER.unpack_from(mapping.mm, 0)
        if magic != MAGIC:
            return f"segment {info['segment']} is not a weight segment (magic {magic:#x})"
        if publish != info["publish"]:
            return "superseded"  # the slot was claimed for a later publish: that one is in latest.json
        end = info["data_offset"] + m.nbytes
        if n != len(m.buckets) or info["data_offset"] < _data_offset(n) or len(mapping.mm) < end:
            return (f"segment {info['segment']} ({len(mapping.mm)} bytes, {n} buckets) does not hold the manifest's "
                    f"{len(m.buckets)} buckets of {m.nbytes} bytes at {info['data_offset']}")
        return None

    def _read_buckets(self, mapping: _Mapping, info: dict[str, Any], key: tuple[int, int, int] | None,
                      shadow: dict[str, torch.Tensor] | None = None) -> bool:
        """Verifies every bucket as the broadcaster writes it, in place or (``shadow``) fused with its copy into the
        shadow's tensors; False (counted) on any failure. Into a shadow, the bytes of the bucket being written are
        copied as the header's progress reports them final, so a large bucket (a big tensor) is not copied only
        after the broadcaster finished it."""
        m: Manifest = info["manifest"]
        start = info["data_offset"]
        offset, last_progress = start, time.monotonic()
        for b in m.buckets:
            data = mapping.buf[offset : offset + b.nbytes]
            scatter = None if shadow is None else BucketScatter(b, data, shadow)
            while True:
                _, _, _, written, state, progress = _HEADER.unpack_from(mapping.mm, 0)
                if written > b.index:
                    break
                now = time.monotonic()
                if scatter is not None and (progress << 20) - (offset - start) > scatter.done and not self._stop.is_set():
                    before = scatter.done
                    scatter.advance((progress << 20) - (offset - start))
                    self._staging.count("bytes_streamed", scatter.done - before)
                    last_progress = now
                    continue
                if state == FAILED or self._stop.is_set() or now - last_progress > self.timeout_s:
                    if not self._stop.is_set():
                        why = ("failed while publishing it" if state == FAILED
                               else f"wrote nothing for {self.timeout_s} s")
                        self._fail(m.version, f"version {m.version}: the broadcaster {why} (bucket {b.index})")
                    return False
                if self._newer_than(key):
                    return self._abandon(m.version)
                time.sleep(SPIN_S)
            if self._stop.is_set():
                return False
            if b.index and self._newer_than(key):  # a newer version: no point verifying this one further
                return self._abandon(m.version)
            (want,) = _CHECKSUM.unpack_from(mapping.mm, _HEADER.size + _CHECKSUM.size * b.index)
            got = self._verify_bucket(b, data) if scatter is None else self._scatter_bucket(b, data, shadow, scatter)
            if got != want:
                self._staging.count("checksum_mismatches")
                self._fail(m.version, f"checksum mismatch in bucket {b.index} of version {m.version}: "
                                      f"got {got:#018x}, the segment says {want:#018x}")
                return False
            offset += b.nbytes
            last_progress = time.monotonic()
            self._staging.count("bytes_received", b.nbytes)
        return True

    def _verify_bucket(self, bucket: Bucket, data: torch.Tensor) -> int:
        """The checksum of one bucket's bytes in the segment (the per-bucket receive step; a test slows it down)."""
        return checksum(memoryview(data.numpy()))

    def _scatter_bucket(self, bucket: Bucket, data: torch.Tensor, shadow: dict[str, torch.Tensor],
                        scatter: BucketScatter) -> int:
        """Copies the rest of one written bucket into the shadow, returning the checksum of what landed (the
        per-bucket step into a shadow; a test slows it down)."""
        scatter.advance(bucket.nbytes)
        return scatter.digest()

    def _abandon(self, version: int) -> bool:
        self._staging.count("abandoned")
        self._last_key = None  # re-read latest.json on the next tick
        logger.info("receiver %s: abandoning version %d for a newer one", self.receiver_id, version)
        return False

