"""Shared-memory backend of weight sync (one machine): both ends of its file protocol.

The broadcaster and its receivers share one directory (by default a fresh one under ``/dev/shm``,
so files live in RAM)::

    v{version}.bin            every bucket of one version back to back, in index order (immutable)
    latest.json               the newest version: {format, version, mode, lora_config, file, nbytes,
                              buckets (Bucket.to_wire, with crc32)}; replaced atomically
    committed-{receiver}.json {receiver_id, version, pid, time}: phase two, written by each receiver

Writers never modify a visible file: each is written under a dot-prefixed temporary name and
``os.replace``d into place, so a reader sees the old file or the new one, never half of one. The
broadcaster deletes the ``.bin`` files of versions older than the newest ``keep_versions``; a
receiver that already opened one keeps reading it (POSIX unlink semantics).

Who blocks on what: the trainer thread blocks in :meth:`ShmWeightBroadcaster.publish` while it
writes (one copy into the file) and checksums the version. Each receiver's I/O thread stats
``latest.json`` every ``poll_s`` (re-reading it only when inode/mtime/size change, or to retry a
failure after ``RETRY_S``), reads the new version's buckets into private buffers, verifies each
crc32 and stages the update; a newer ``latest.json`` between two buckets abandons the older
version. The worker's thread blocks only in :meth:`ShmWeightReceiver.wait`. A vanished, truncated
or corrupted file is a counted, logged failure: nothing is staged and the committed version stays.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import torch

from asyncrl.codec import DecodeError
from asyncrl.weights._staging import (
    MODES,
    StagingArea,
    buckets_from_wire,
    check_publish,
    check_receiver_id,
    tensor_bytes,
    unpack_bucket,
)
from asyncrl.weights.base import (
    WeightBroadcaster,
    WeightMode,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
    bucket_checksum,
    plan_buckets,
)

__all__ = ["ShmWeightBroadcaster", "ShmWeightReceiver"]

logger = logging.getLogger(__name__)

FORMAT = 1
LATEST = "latest.json"
RETRY_S = 1.0
"""A failed version is read again at the earliest this long after the failure."""
_BIN_NAME = re.compile(r"v\d{1,20}\.bin")
_ZEROS = bytes(1 << 16)


def _default_directory() -> str:
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="asyncrl-weights-", dir=base)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _crc_zeros(n: int, crc: int) -> int:
    while n > 0:
        crc = zlib.crc32(_ZEROS[: min(n, len(_ZEROS))], crc)
        n -= len(_ZEROS)
    return crc


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)  # one call moves at most ~2 GiB on Linux
        data, offset = data[n:], offset + n


def _pread_into(fd: int, out: memoryview, offset: int) -> int:
    done = 0
    while done < out.nbytes:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _cleanup(directory: str, owned: bool, written: collections.deque[str]) -> None:
    if owned:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for name in [*written, LATEST]:
        Path(directory, name).unlink(missing_ok=True)


class ShmWeightBroadcaster(WeightBroadcaster):
    """Trainer end: writes each version into a file in a shared directory.

    Args:
        directory: the shared directory (created if missing). Default: a fresh directory under
            ``/dev/shm`` (else the system temp dir), removed on :meth:`close`; a given directory
            keeps everything but the files this broadcaster wrote.
        bucket_bytes: the bucket size (checksum granularity; a larger tensor gets its own bucket).
        keep_versions: ``.bin`` files kept (the newest is always kept).
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, bucket_bytes: int = 64 << 20,
                 keep_versions: int = 2):
        if bucket_bytes <= 0 or keep_versions < 1:
            raise ValueError(f"{bucket_bytes=} must be > 0 and {keep_versions=} >= 1")
        owned = directory is None
        self.directory = Path(_default_directory() if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = bucket_bytes
        self.keep_versions = keep_versions
        self._lock = threading.Lock()
        self._last_version: int | None = None
        self._written: collections.deque[str] = collections.deque()
        self._corrupt_next: int | None = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._finalizer = weakref.finalize(self, _cleanup, str(self.directory), owned, self._written)

    @property
    def address(self) -> str:
        return str(self.directory)

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: WeightMode = "full",
        lora_config: dict[str, Any] | None = None,
        incarnation: str = "",
    ) -> dict[str, Any]:
        with self._lock:
            check_publish(tensors, version, self._last_version, mode, lora_config)
            orjson.dumps(lora_config)  # TypeError here, before anything is visible to receivers
            corrupt, self._corrupt_next = self._corrupt_next, None
            t0 = time.perf_counter()
            buckets = plan_buckets(tensors, self.bucket_bytes)
            if corrupt is not None and (not 0 <= corrupt < len(buckets) or buckets[corrupt].nbytes == 0):
                raise ValueError(f"corrupt_next({corrupt}): version {version} has {len(buckets)} buckets "
                                 f"and that one must hold bytes")
            name = f"v{version}.bin"
            nbytes = self._write_bin(name, tensors, buckets, corrupt)
            manifest = {"format": FORMAT, "version": version, "incarnation": incarnation, "mode": mode,
                        "lora_config": lora_config,
                        "file": name, "nbytes": nbytes, "buckets": [b.to_wire() for b in buckets]}
            _write_atomic(self.directory / LATEST, orjson.dumps(manifest))
            self._last_version = version
            self._written.append(name)
            while len(self._written) > self.keep_versions:
                (self.directory / self._written.popleft()).unlink(missing_ok=True)
            self._counters["versions_published"] += 1
        return {"version": version, "bytes": nbytes, "buckets": len(buckets), "publish_s": time.perf_counter() - t0}

    def _write_bin(self, name: str, tensors: Mapping[str, torch.Tensor], buckets: list, corrupt: int | None) -> int:
        """Writes the buckets to ``name`` (via a temp file) and fills in their checksums; returns the size."""
        tmp = self.directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        base = 0
        try:
            os.ftruncate(fd, sum(b.nbytes for b in buckets))  # padding between tensors reads as zeros
            for b in buckets:
                crc, end = 0, 0
                for slot in b.slots:
                    crc = _crc_zeros(slot.offset - end, crc)
                    data = tensor_bytes(tensors[slot.name])
                    crc = zlib.crc32(data, crc)
                    _pwrite_all(fd, data, base + slot.offset)
                    end = slot.offset + slot.nbytes
                b.checksum = _crc_zeros(b.nbytes - end, crc)
                if corrupt == b.index:  # fault injection: the manifest keeps the true checksum
                    at = base + b.nbytes // 2
                    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
                base += b.nbytes
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, self.directory / name)
        return base

    def corrupt_next(self, bucket_index: int) -> None:
        """Fault injection for tests: the next published version has ``bucket_index`` corrupted.

        One byte of that bucket is flipped in the file after its checksum was computed, so every
        read of that version fails (retries too). The version after it is clean.
        """
        with self._lock:
            self._corrupt_next = bucket_index

    def committed(self) -> dict[str, int]:
        out = {}
        for path in self.directory.glob("committed-*.json"):
            try:
                record = orjson.loads(path.read_bytes())
                out[check_receiver_id(record["receiver_id"])] = int(record["version"])
            except (OSError, ValueError, KeyError, TypeError) as e:  # a receiver's file, not ours: skip it
                self._counters["bad_commit_files"] += 1
                logger.debug("skipping unreadable %s: %s", path, e)
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counters, "versions": [int(n[1:-4]) for n in self._written],
                    "directory": str(self.directory)}

    def close(self) -> None:
        self._finalizer()


class ShmWeightReceiver(WeightReceiver):
    """Worker end: an I/O thread that watches ``latest.json`` and stages the newest version.

    Args:
        directory: the broadcaster's :attr:`~ShmWeightBroadcaster.address`.
        receiver_id: unique name of this worker; names its ``committed-*.json`` file.
        poll_s: how often ``latest.json`` is stat'ed.
    """

    def __init__(self, directory: str | os.PathLike, *, receiver_id: str, poll_s: float = 0.02):
        if poll_s <= 0:
            raise ValueError(f"{poll_s=} must be > 0")
        self.directory = Path(directory)
        self.receiver_id = check_receiver_id(receiver_id)
        self.poll_s = poll_s
        self._staging = StagingArea(receiver_id)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # I/O thread only:
        self._last_key: tuple[int, int, int] | None = None
        self._retry_after: float | None = None
        self._finalizer = weakref.finalize(self, self._stop.set)

    # -- worker thread -------------------------------------------------------------------------
    def start(self) -> None:
        """Starts watching the directory.

        Raises:
            WeightSyncError: if the directory does not exist.
        """
        if self._thread is not None:
            return
        if not self.directory.is_dir():
            raise WeightSyncError(f"receiver {self.receiver_id}: weight directory {str(self.directory)!r} does not "
                                  "exist; pass the broadcaster's address")
        self._thread = threading.Thread(target=self._run, name=f"asyncrl-weights-{self.receiver_id}", daemon=True)
        self._thread.start()

    def poll(self) -> WeightUpdate | None:
        return self._staging.poll()

    def wait(self, version: int, timeout: float, *, incarnation: str | None = None) -> WeightUpdate | None:
        return self._staging.wait(version, timeout, incarnation)

    def commit(self, version: int) -> None:
        self._staging.commit(version)
        record = {"receiver_id": self.receiver_id, "version": version, "pid": os.getpid(), "time": time.time()}
        try:
            _write_atomic(self.directory / f"committed-{self.receiver_id}.json", orjson.dumps(record))
        except OSError as e:  # the engine runs the version either way; only the report is lost
            self._staging.count("commit_report_failed")
            logger.warning("receiver %s: cannot record commit of version %d: %s", self.receiver_id, version, e)

    @property
    def committed_version(self) -> int | None:
        return self._staging.committed_version

    def stats(self) -> dict[str, Any]:
        out = self._staging.stats()
        out.update(receiver_id=self.receiver_id, address=str(self.directory))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._staging.close()
        self._finalizer()

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self._check_once(time.monotonic())
        except BaseException as e:  # thread boundary: poll()/wait() re-raise it in the worker's thread
            logger.exception("receiver %s: weight I/O thread died", self.receiver_id)
            self._staging.die(e)

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.directory / LATEST)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _check_once(self, now: float) -> None:
        key = self._stat_key()
        retry = self._retry_after is not None and now >= self._retry_after
        if key is None or (key == self._last_key and not retry):
            return
        self._last_key, self._retry_after = key, None
        manifest = self._read_manifest(now)
        if manifest is None:
            return
        if self._staging.is_newer(manifest["version"], manifest["incarnation"]):
            self._fetch(manifest, now)

    def _read_manifest(self, now: float) -> dict[str, Any] | None:
        try:
            m = orjson.loads((self.directory / LATEST).read_bytes())
            if not isinstance(m, dict) or m.get("format") != FORMAT:
                raise DecodeError(f"{LATEST} is not format {FORMAT}")
            if type(m.get("version")) is not int or m.get("mode") not in MODES:
                raise DecodeError(f"{LATEST}: bad version {m.get('version')!r:.20} or mode {m.get('mode')!r:.20}")
            if not isinstance(m.get("lora_config"), (dict, type(None))):
                raise DecodeError(f"{LATEST}: lora_config must be a map or null")
            m.setdefault("incarnation", "")
            if not isinstance(m["incarnation"], str) or len(m["incarnation"]) > 64:
                raise DecodeError(f"{LATEST}: incarnation must be a string of at most 64 chars")
            if not isinstance(m.get("file"), str) or not _BIN_NAME.fullmatch(m["file"]):
                raise DecodeError(f"{LATEST}: bad file name {m.get('file')!r:.60}")
            m["buckets"] = buckets_from_wire(m.get("buckets"))
            if m.get("nbytes") != sum(b.nbytes for b in m["buckets"]):
                raise DecodeError(f"{LATEST}: nbytes {m.get('nbytes')!r:.20} is not the sum of its buckets")
            return m
        except FileNotFoundError:  # replaced between stat and read: the next tick sees the new one
            self._last_key = None
            return None
        except (orjson.JSONDecodeError, DecodeError) as e:
            self._fail(now, None, f"unreadable {LATEST}: {e}")
            return None

    def _newer_than(self, version: int) -> bool:
        key = self._stat_key()
        if key is None or key == self._last_key:
            return False
        try:
            return orjson.loads((self.directory / LATEST).read_bytes())["version"] > version
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError):  # mid-replace or broken: decide next tick
            return False

    def _fetch(self, m: dict[str, Any], now: float) -> None:
        version, path, started = m["version"], self.directory / m["file"], time.monotonic()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._fail(now, version, f"{path} vanished before it could be read")
            return
        buffers = []
        try:
            if (size := os.fstat(fd).st_size) != m["nbytes"]:
                self._fail(now, version, f"{path} has {size} bytes, the manifest says {m['nbytes']}")
                return
            offset = 0
            for b in m["buckets"]:
                if self._stop.is_set():
                    return
                if self._newer_than(version):
                    self._staging.count("abandoned")
                    self._last_key = None  # re-read latest.json on the next tick
                    logger.info("receiver %s: abandoning version %d for a newer one", self.receiver_id, version)
                    return
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                got = _pread_into(fd, view, offset)
                checksum = bucket_checksum(view)
                if got != b.nbytes or checksum != b.checksum:
                    self._fail(now, version, f"bucket {b.index} of version {version}: read {got}/{b.nbytes} bytes, "
                                             f"checksum {checksum:#010x}, the manifest says {b.checksum:#010x}")
                    return
                buffers.append(buf)
                offset += b.nbytes
                self._staging.count("bytes_received", b.nbytes)
        finally:
            os.close(fd)
        tensors: dict[str, torch.Tensor] = {}
        for b, buf in zip(m["buckets"], buffers):
            tensors.update(unpack_bucket(b, buf))
        meta = {"receiver_id": self.receiver_id, "buckets": len(buffers), "staged_at": time.monotonic(),
                "transfer_s": time.monotonic() - started}
        self._staging.stage(WeightUpdate(version=version, mode=m["mode"], tensors=tensors,
                                         lora_config=m["lora_config"], metadata=meta, incarnation=m["incarnation"]))

    def _fail(self, now: float, version: int | None, reason: str) -> None:
        self._staging.fail(version, reason)
        self._retry_after = now + RETRY_S
        logger.warning("receiver %s: weight transfer failed (%s); keeping committed version %s, retrying in %.1f s",
                       self.receiver_id, reason, self._staging.committed_version, RETRY_S)
