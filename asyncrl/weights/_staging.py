"""Private machinery shared by the weight backends: bucket packing, verified unpacking, staging.

* Broadcaster side: :func:`check_publish` validates a publish call; :func:`fill_bucket` copies tensors
  into one bucket's contiguous uint8 buffer (``detach().cpu().contiguous()`` in a single copy, padding
  zeroed so the bytes on the wire are deterministic); :func:`tensor_bytes` gives a tensor's bytes as a
  memoryview without a copy (for writers that stream tensors, e.g. into a file).
* Receiver side: :func:`buckets_from_wire` validates a manifest a peer controls; :func:`unpack_bucket`
  views the tensors of one verified bucket inside a buffer the receiver owns.
* :class:`StagingArea`: the two-phase state of one receiver. Its I/O thread stages verified updates
  and records failures; the worker's thread polls, waits and commits. Only ``wait`` blocks (on a
  condition variable, with a timeout); everything else takes the lock briefly.
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.codec import DecodeError
from asyncrl.weights.base import Bucket, TensorSlot, WeightSyncError, WeightUpdate, tensor_specs

__all__ = [
    "DTYPES",
    "MODES",
    "StagingArea",
    "buckets_from_wire",
    "check_publish",
    "check_receiver_id",
    "fill_bucket",
    "tensor_bytes",
    "unpack_bucket",
]

MODES = ("full", "lora")
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
}
MAX_RECENT_FAILURES = 8
_RECEIVER_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def check_receiver_id(receiver_id: Any) -> str:
    """Receiver ids name files (shm backend) and appear in logs: 1-128 of ``[A-Za-z0-9_.-]``."""
    if not isinstance(receiver_id, str) or not _RECEIVER_ID.fullmatch(receiver_id):
        raise ValueError(f"{receiver_id=} must be 1-128 characters of [A-Za-z0-9_.-]")
    return receiver_id


def check_publish(
    tensors: Mapping[str, torch.Tensor], version: int, last: int | None, mode: str, lora_config: Any
) -> None:
    """Raises ``ValueError``/``TypeError`` for a publish call that must not reach receivers."""
    if type(version) is not int:
        raise TypeError(f"version must be an int, got {type(version).__name__} ({version!r})")
    if last is not None and version <= last:
        raise ValueError(f"{version=} must be greater than the last published version {last}")
    if mode not in MODES:
        raise ValueError(f"{mode=} must be one of {MODES}")
    if lora_config is not None and (mode != "lora" or not isinstance(lora_config, dict)):
        raise ValueError(f"lora_config must be a dict and only given with mode='lora' (got {mode=}, "
                         f"lora_config of type {type(lora_config).__name__})")
    for name, t in tensor_specs(tensors).items():  # metadata: a streamed state gathers nothing here
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors must map str -> torch.Tensor, got {type(name).__name__} -> {type(t).__name__}")
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")


def fill_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copies the bucket's tensors into ``out`` (uint8, ``bucket.nbytes`` long) at their offsets."""
    end = 0
    for slot in bucket.slots:
        if slot.offset > end:
            out[end : slot.offset].zero_()
        if slot.nbytes:
            src = tensors[slot.name].detach()
            out[slot.offset : slot.offset + slot.nbytes].view(src.dtype).view(src.shape).copy_(src)
        end = slot.offset + slot.nbytes
    if end < bucket.nbytes:
        out[end:].zero_()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, C-contiguous on the CPU (copies only if it is not already)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def buckets_from_wire(items: Any) -> list[Bucket]:
    """Parses and checks a manifest's buckets (peer input).

    Raises:
        DecodeError: for anything that would make :func:`unpack_bucket` read outside a bucket,
            mistype a tensor or drop one.
    """
    if not isinstance(items, list):
        raise DecodeError(f"manifest buckets must be a list, got {type(items).__name__}")
    buckets: list[Bucket] = []
    names: set[str] = set()
    for position, item in enumerate(items):
        try:
            bucket = Bucket.from_wire(item)
        except (KeyError, TypeError, ValueError) as e:
            raise DecodeError(f"malformed bucket {position}: {type(e).__name__}: {e}") from e
        if bucket.index != position or type(bucket.nbytes) is not int or bucket.nbytes < 0:
            raise DecodeError(f"bucket {position}: index {bucket.index!r} / nbytes {bucket.nbytes!r} invalid")
        if type(bucket.checksum) is not int or not 0 <= bucket.checksum < 2**32:
            raise DecodeError(f"bucket {position}: checksum {bucket.checksum!r} is not a crc32")
        for slot in bucket.slots:
            _check_slot(position, bucket.nbytes, slot)
            if slot.name in names:
                raise DecodeError(f"tensor {slot.name!r:.100} appears twice in the manifest")
            names.add(slot.name)
        buckets.append(bucket)
    return buckets


def _check_slot(position: int, bucket_nbytes: int, slot: TensorSlot) -> None:
    where = f"bucket {position}, tensor {slot.name!r:.100}"
    if not isinstance(slot.name, str) or slot.dtype not in DTYPES:
        raise DecodeError(f"{where}: bad name or dtype {slot.dtype!r:.40}")
    if not all(type(d) is int and d >= 0 for d in slot.shape) or len(slot.shape) > 16:
        raise DecodeError(f"{where}: bad shape {slot.shape!r:.100}")
    itemsize = DTYPES[slot.dtype].itemsize
    if type(slot.nbytes) is not int or slot.nbytes != math.prod(slot.shape) * itemsize:
        raise DecodeError(f"{where}: nbytes {slot.nbytes!r} does not match {slot.dtype}{slot.shape}")
    if type(slot.offset) is not int or slot.offset < 0 or slot.offset % itemsize:
        raise DecodeError(f"{where}: offset {slot.offset!r} is negative or misaligned for {slot.dtype}")
    if slot.offset + slot.nbytes > bucket_nbytes:
        end = slot.offset + slot.nbytes
        raise DecodeError(f"{where}: bytes [{slot.offset}, {end}) exceed the bucket's {bucket_nbytes}")


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views the bucket's tensors in ``buf`` (uint8, owned by the caller); no copy.

    ``bucket`` must come from :func:`buckets_from_wire` and ``buf`` must hold verified bytes.
    """
    out = {}
    for slot in bucket.slots:
        dtype = DTYPES[slot.dtype]
        if slot.nbytes == 0:
            out[slot.name] = torch.empty(slot.shape, dtype=dtype)
        else:
            out[slot.name] = buf[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)
    return out


class StagingArea:
    """Receiver state: the newest staged update, the committed version, counters and failures.

    Lifecycle of a version: ``fetching`` (I/O thread, private buffers) ``-> staged`` (all buckets
    verified; :meth:`poll`/:meth:`wait` return it) ``-> committed`` (the worker applied it and called
    :meth:`commit`; the staged reference is dropped). A failed transfer never reaches ``staged``.

    Args:
        name: for log and error messages (the receiver id).
    """

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._staged: WeightUpdate | None = None
        self._staged_recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=16)
        self._committed: int | None = None
        self._committed_incarnation = ""
        self._closed = False
        self._error: BaseException | None = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_RECENT_FAILURES)
        self._info: dict[str, Any] = {}

    # -- I/O thread ----------------------------------------------------------------------------
    def newest(self) -> int | None:
        """The newest version staged or committed (what a transfer must beat)."""
        with self._cv:
            versions = [v for v in (self._committed, self._staged and self._staged.version) if v is not None]
            return max(versions) if versions else None

    def is_newer(self, version: int, incarnation: str) -> bool:
        """Whether a transfer of ``(incarnation, version)`` beats what is staged or committed: a newer
        version, or another incarnation (a resumed trainer reuses version numbers; its weights win)."""
        with self._cv:
            s = self._staged
            have, have_inc = (s.version, s.incarnation) if s is not None else (self._committed, self._committed_incarnation)
            return have is None or incarnation != have_inc or version > have

    def newest_incarnation(self) -> str:
        with self._cv:
            return self._staged.incarnation if self._staged is not None else self._committed_incarnation

    def stage(self, update: WeightUpdate) -> None:
        with self._cv:
            self._staged = update
            self._staged_recent.append((update.version, update.incarnation))
            self._counters["versions_staged"] += 1
            self._counters["bytes_staged"] += update.nbytes
            self._info["staged_version"] = update.version
            self._info["last_transfer_s"] = update.metadata.get("transfer_s")
            self._cv.notify_all()

    def fail(self, version: int | None, reason: str) -> None:
        with self._cv:
            self._counters["failures"] += 1
            self._failures.append({"version": version, "reason": reason[:500], "time": time.time()})

    def count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._counters[key] += n

    def set_info(self, **info: Any) -> None:
        with self._cv:
            self._info.update(info)

    def die(self, error: BaseException) -> None:
        """The I/O thread crashed: ``poll``/``wait`` re-raise ``error`` in the worker's thread."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- worker thread -------------------------------------------------------------------------
    def _ready(self, version: int | None, incarnation: str | None = None) -> WeightUpdate | None:
        if self._error is not None:
            raise WeightSyncError(f"receiver {self.name}: weight I/O thread died: {self._error!r}") from self._error
        s = self._staged
        if s is None or (self._committed is not None and s.incarnation == self._committed_incarnation
                         and s.version <= self._committed):
            return None
        if incarnation is not None and s.incarnation and s.incarnation != incarnation:
            return None  # another incarnation's weights (a publisher without incarnations matches any)
        return s if version is None or s.version >= version else None

    def poll(self) -> WeightUpdate | None:
        with self._cv:
            return self._ready(None)

    def wait(self, version: int, timeout: float, incarnation: str | None = None) -> WeightUpdate | None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while (update := self._ready(version, incarnation)) is None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cv.wait(remaining)
            return update

    def commit(self, version: int) -> None:
        """Records ``version`` as applied; raises ``ValueError`` unless it was staged and is newer."""
        with self._cv:
            staged = [inc for v, inc in self._staged_recent if v == version]
            if not staged:
                raise ValueError(f"receiver {self.name}: commit({version}) of a version never staged "
                                 f"(recently staged: {list(self._staged_recent)})")
            incarnation = staged[-1]
            if self._committed is not None and incarnation == self._committed_incarnation and version <= self._committed:
                raise ValueError(
                    f"receiver {self.name}: commit({version}) is not newer than committed {self._committed}"
                )
            self._committed, self._committed_incarnation = version, incarnation
            if self._staged is not None and self._staged.version <= version and self._staged.incarnation == incarnation:
                self._staged = None  # the engine holds the tensors now; free ours
            self._counters["versions_committed"] += 1

    @property
    def committed_version(self) -> int | None:
        with self._cv:
            return self._committed

    def stats(self) -> dict[str, Any]:
        with self._cv:
            out: dict[str, Any] = {"failures": 0, "versions_staged": 0, "versions_committed": 0, "abandoned": 0}
            out.update(self._counters)
            out.update(self._info)
            out["committed_version"] = self._committed
            out["committed_incarnation"] = self._committed_incarnation
            s = self._staged
            fresh = s is not None and (self._committed is None or s.version > self._committed
                                       or s.incarnation != self._committed_incarnation)
            out["pending_version"] = s.version if fresh else None
            out["error"] = None if self._error is None else repr(self._error)
            out["recent_failures"] = list(self._failures)
            return out
