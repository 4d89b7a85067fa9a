"""Private machinery shared by the weight backends: publish checks, views of staged buckets, staging.

* Broadcaster side: :func:`check_publish` validates a publish call; :func:`tensor_bytes` gives a tensor's
  bytes as a memoryview without a copy. (Copies into buckets are fused with the checksum:
  :mod:`asyncrl.weights._checksum`.)
* Receiver side: :func:`unpack_bucket` views the tensors of one verified bucket inside a buffer the
  receiver owns (a reused receive buffer, a shared-memory segment): the engine loads from those views.
* :class:`StagingArea`: the two-phase state of one receiver. Its I/O thread stages verified updates
  and records failures; the worker's thread polls, waits and commits. Only ``wait`` blocks (on a
  condition variable, with a timeout); everything else takes the lock briefly. It also decides when the
  memory under a staged update may be reused (its *hold* is released), see :class:`StagingArea`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from asyncrl.codec import TENSOR_DTYPES
from asyncrl.weights.base import Bucket, WeightSyncError, WeightUpdate, plan_buckets, tensor_specs
from asyncrl.weights.protocol import MODES

__all__ = [
    "DTYPES",
    "MODES",
    "StagingArea",
    "check_filled",
    "check_publish",
    "check_receiver_id",
    "plan_publish",
    "tensor_bytes",
    "unpack_bucket",
]

DTYPES = TENSOR_DTYPES
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
        raise ValueError(
            f"{version=} must be greater than the last published version {last}: a broadcaster publishes each version "
            "once. A loop that rebuilt its RolloutLoader on this live broadcaster carries on from the published "
            "version: RolloutLoader(..., incarnation=old_loader.incarnation), then PolicySync(model, loader, "
            f"broadcaster, version={last}, publish_initial=False) (docs/guides/your-loop.md, 'Rebuilding the loader')")
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


def plan_publish(tensors: Mapping[str, torch.Tensor], version: int, last: int | None, mode: str, lora_config: Any,
                 bucket_bytes: int, plan: Sequence[Bucket] | None = None) -> list[Bucket]:
    """:func:`check_publish`, then the version's buckets (:func:`~asyncrl.weights.base.plan_buckets`): the start of
    every bucketed backend's ``_publish``.

    ``plan``: the buckets a re-served version arrived in, with their checksums (a relay's, :mod:`asyncrl.weights.relay`);
    they are used as they are (copies), after checking that they hold exactly ``tensors``, so that each bucket written
    can be held to its checksum (:func:`check_filled`).

    Raises:
        ValueError: a ``plan`` that does not hold exactly ``tensors`` (names, dtypes, shapes).
    """
    check_publish(tensors, version, last, mode, lora_config)
    if plan is None:
        return plan_buckets(tensors, bucket_bytes)
    specs = tensor_specs(tensors)
    planned = {s.name: (s.dtype, list(s.shape)) for b in plan for s in b.slots}
    given = {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in specs.items()}
    if planned != given:
        diff = sorted(k for k in planned.keys() | given.keys() if planned.get(k) != given.get(k))
        raise ValueError(f"the bucket plan does not hold the tensors published with it: {len(diff)} differ "
                         f"(first: {diff[:3]}); re-serve an update with the plan it arrived in")
    return [dataclasses.replace(b, slots=list(b.slots)) for b in plan]


def check_filled(bucket: Bucket, checksum: int, planned: bool) -> int:
    """Returns ``checksum``, the hash of what a backend just wrote for ``bucket``; for a re-served version (``planned``)
    it must be the checksum the bucket arrived with, so receivers downstream verify against the trainer's own.

    Raises:
        WeightSyncError: the bytes written differ from the ones verified on arrival (the version must not be served).
    """
    if planned and checksum != bucket.checksum:
        raise WeightSyncError(f"bucket {bucket.index} hashes to {checksum:#018x} as re-served, but arrived verified as "
                              f"{bucket.checksum:#018x}: the version is not served")
    return checksum


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, C-contiguous on the CPU (copies only if it is not already)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views the bucket's tensors in ``buf`` (uint8, owned by the caller); no copy.

    ``bucket`` must come from :func:`asyncrl.weights.protocol.buckets_from_wire` and ``buf`` hold verified bytes.
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

    Lifecycle of a version: ``fetching`` (I/O thread, its buffers) ``-> staged`` (all buckets
    verified; :meth:`poll`/:meth:`wait` return it) ``-> committed`` (the worker applied it and called
    :meth:`commit`; the staged reference is dropped). A failed transfer never reaches ``staged``.

    Holds: the tensors of a staged update are views into memory the backend reuses (a receive buffer, a
    shared-memory slot). :meth:`stage` takes a ``release`` callback; it is called (once, in whichever thread
    made the update unused) when the update is neither staged nor *handed out*: an update returned by
    :meth:`poll`/:meth:`wait` stays valid until its version is committed or a later call returns another
    update. So an engine loading from the views never sees them change, and an update superseded before the
    worker looked at it frees its memory at once.

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
        self._handed: WeightUpdate | None = None
        self._holds: dict[int, tuple[WeightUpdate, Callable[[], None]]] = {}
        self._listeners: list[Callable[[], None]] = []

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

    def stage(self, update: WeightUpdate, release: Callable[[], None] | None = None) -> None:
        """Makes ``update`` the staged one; ``release()`` is called once it is unused (see the class)."""
        with self._cv:
            if release is not None:
                self._holds[id(update)] = (update, release)
            self._staged = update
            self._staged_recent.append((update.version, update.incarnation))
            self._counters["versions_staged"] += 1
            self._counters["bytes_staged"] += update.nbytes
            self._info["staged_version"] = update.version
            self._info["last_transfer_s"] = update.metadata.get("transfer_s")
            self._cv.notify_all()
            if self._closed:  # staged while the receiver closed: nobody will apply it
                self._staged = None
            unused = self._take_unused()
            listeners = list(self._listeners)
        _release(unused)
        for listener in listeners:  # outside the lock: a listener may take its own, then call poll()/wait()
            listener()

    def listen(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` (in the staging thread, no lock held) after every version staged from now on: a
        receiver made of several (:class:`~asyncrl.weights.relayed.RelayedWeightReceiver`) waits on its own
        condition."""
        with self._cv:
            self._listeners.append(callback)

    def _take_unused(self) -> list[Callable[[], None]]:
        """(Under the lock.) Pops the release callbacks of updates neither staged nor handed out."""
        done = [k for k, (u, _) in self._holds.items() if u is not self._staged and u is not self._handed]
        return [self._holds.pop(k)[1] for k in done]

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
        """Wakes waiters and releases every hold (the receiver is closing: nothing is applied any more)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self._staged = self._handed = None
            unused = self._take_unused()
        _release(unused)

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

    def _hand(self, update: WeightUpdate | None) -> tuple[WeightUpdate | None, list[Callable[[], None]]]:
        if update is None or update is self._handed:
            return update, []
        self._handed = update
        return update, self._take_unused()

    def poll(self) -> WeightUpdate | None:
        with self._cv:
            update, unused = self._hand(self._ready(None))
        _release(unused)
        return update

    def wait(self, version: int, timeout: float, incarnation: str | None = None) -> WeightUpdate | None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while (update := self._ready(version, incarnation)) is None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cv.wait(remaining)
            update, unused = self._hand(update)
        _release(unused)
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
            if self._handed is not None and self._handed.version <= version and self._handed.incarnation == incarnation:
                self._handed = None
            self._counters["versions_committed"] += 1
            unused = self._take_unused()
        _release(unused)

    def adopt(self, version: int, incarnation: str) -> None:
        """Records ``(incarnation, version)`` as what the engine runs, applied from another receiver (a worker's relay
        and its direct path, :mod:`asyncrl.weights.relayed`): what is staged and not a newer version of that
        incarnation is dropped (its hold released; another incarnation's is taken as older: the other receiver got
        it from the trainer more recently), and a transfer that would not beat it is not started. Counted as
        ``versions_adopted``, not committed; nothing is reported to this receiver's broadcaster."""
        with self._cv:
            if (self._committed is not None and incarnation == self._committed_incarnation
                    and version <= self._committed):
                return
            self._committed, self._committed_incarnation = version, incarnation
            for attr in ("_staged", "_handed"):
                u = getattr(self, attr)
                if u is not None and (u.incarnation != incarnation or u.version <= version):
                    setattr(self, attr, None)
            self._counters["versions_adopted"] += 1
            unused = self._take_unused()
        _release(unused)

    @property
    def committed_version(self) -> int | None:
        with self._cv:
            return self._committed

    @property
    def committed_incarnation(self) -> str:
        with self._cv:
            return self._committed_incarnation

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
            out["held_updates"] = len(self._holds)
            return out


def _release(callbacks: list[Callable[[], None]]) -> None:
    for release in callbacks:
        release()
