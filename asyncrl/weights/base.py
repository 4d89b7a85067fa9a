"""Weight sync from the trainer to rollout workers: the two ends, the update, the bucket plan.

::

    trainer: optimizer.step() ─► broadcaster.publish(tensors, version=v+1)      (snapshot into buckets)
                                        │  bucketed transfer (bounded: one bucket per frame/copy)
    worker I/O thread: receiver ── stage every bucket, verify its checksum ──► staged update (phase 1)
    worker main thread, at a safe point: update = receiver.poll() → engine.apply_weights(update)
                                          → receiver.commit(update.version)                (phase 2)
                                          → only now do new rollouts carry version v+1

A receiver pulls the latest committed version (a worker that joins late gets the current weights;
one that falls behind skips straight to the newest). A transfer that fails (peer gone, a bucket
corrupted, a newer version published mid-transfer) is discarded whole and counted: the worker keeps
generating with the version it has. One file per backend holds both ends (``zmq.py`` across
machines, ``shm.py`` on one machine, ``cuda_ipc.py`` and ``nccl.py`` for GPUs) behind the same two classes.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import xxhash

__all__ = [
    "Bucket",
    "TensorSlot",
    "WeightBroadcaster",
    "WeightReceiver",
    "WeightSyncError",
    "WeightUpdate",
    "bucket_checksum",
    "plan_buckets",
    "tensor_specs",
]

WeightMode = Literal["full", "lora"]


class WeightSyncError(RuntimeError):
    """A weight transfer failed (corrupt bucket, peer gone, protocol violation); nothing was committed."""


@dataclass(kw_only=True, slots=True)
class WeightUpdate:
    """A complete, verified set of weights for one policy version."""

    version: int
    mode: WeightMode
    tensors: dict[str, torch.Tensor]
    """``full``: the model's state dict names (HF naming); ``lora``: peft adapter state dict names
    (``get_peft_model_state_dict``)."""
    lora_config: dict[str, Any] | None = None
    """``lora`` mode: the peft ``LoraConfig`` as a dict (``to_dict()``)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    incarnation: str = ""
    """The trainer incarnation that published it (:mod:`asyncrl.pool.timeline`): a new incarnation's weights
    replace the committed ones whatever their version (a resumed run reuses version numbers)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(kw_only=True, slots=True)
class TensorSlot:
    name: str
    dtype: str
    shape: list[int]
    offset: int
    """Byte offset inside the bucket."""
    nbytes: int


@dataclass(kw_only=True, slots=True)
class Bucket:
    index: int
    nbytes: int
    slots: list[TensorSlot]
    checksum: int = 0
    """:func:`bucket_checksum` of the bucket bytes (corruption check; use CURVE for authenticity). 0 in a
    manifest sent before the bucket was written: the backends then carry it with the bucket."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "slots": [[s.name, s.dtype, s.shape, s.offset, s.nbytes] for s in self.slots],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Bucket:
        slots = [TensorSlot(name=n, dtype=dt, shape=list(sh), offset=o, nbytes=nb) for n, dt, sh, o, nb in d["slots"]]
        return cls(index=d["index"], nbytes=d["nbytes"], slots=slots, checksum=d["checksum"])


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The dtype and shape of every tensor to publish, without materializing any: a streamed state
    (:class:`asyncrl.weights.state.PolicyState`, FSDP2) gathers a tensor only when ``tensors[name]`` is read,
    so a broadcaster reads metadata from here and each ``tensors[name]`` once, in order."""
    return getattr(tensors, "specs", tensors)


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Packs tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Offsets are 64-byte aligned so receivers can view tensors in place.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"{bucket_bytes=} must be > 0")
    buckets: list[Bucket] = []
    current: list[TensorSlot] = []
    offset = 0
    for name, t in tensor_specs(tensors).items():
        nbytes = t.numel() * t.element_size()
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(index=len(buckets), nbytes=offset, slots=current))
            current, offset = [], 0
        current.append(TensorSlot(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset, nbytes=nbytes))
        offset += (nbytes + 63) // 64 * 64
    if current:
        buckets.append(Bucket(index=len(buckets), nbytes=offset, slots=current))
    return buckets


def bucket_checksum(data: memoryview | bytes | bytearray) -> int:
    """xxh3-64 of a buffer's bytes, hashed in place (``asyncrl.weights._checksum`` fuses it with copies)."""
    return xxhash.xxh3_64_intdigest(data)


class WeightBroadcaster(abc.ABC):
    """Trainer end: publishes one version at a time; receivers pull the newest.

    :meth:`publish` is every backend's: refused at once if the backend's I/O thread died, one publish at a time,
    timed, the same result keys. A backend implements :meth:`_publish` (check the call, snapshot the tensors into its
    buckets, make the version the one receivers pull) and calls ``WeightBroadcaster.__init__`` first.
    """

    def __init__(self) -> None:
        self._publish_lock = threading.Lock()
        """Publishes are one at a time (a second caller waits for the first)."""
        self._error: BaseException | None = None
        """Set by a backend whose I/O thread died: every later publish raises with it."""
        self._last_version: int | None = None
        """The newest version published (a new one must be greater)."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What a receiver needs to connect (an endpoint or a path)."""

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: WeightMode = "full",
        lora_config: dict[str, Any] | None = None,
        incarnation: str = "",
        plan: Sequence[Bucket] | None = None,
    ) -> dict[str, Any]:
        """Snapshots ``tensors`` as ``version`` of ``incarnation`` (the loader's) and makes it the one receivers pull.

        ``plan`` re-serves a version that arrived verified (a relay, :mod:`asyncrl.weights.relay`): the buckets and
        checksums it arrived in (``update.metadata["plan"]`` of a ``zmq`` receiver's update). The version is
        packed in exactly those buckets and each one written must hash to its checksum, else the publish fails
        and receivers stage nothing of it; so receivers downstream verify against the trainer's checksums. ``shm``
        and ``zmq`` only.

        Returns:
            stats: ``version``, ``bytes``, ``buckets``, the backend's own timings (seconds spent snapshotting or
            waiting for a free slot) and ``publish_s``, the whole call.

        Raises:
            ValueError: if ``version`` is not greater than the last published one, or a ``plan`` the backend cannot
                follow (another layout; nccl, cuda_ipc).
            WeightSyncError: the backend's I/O thread died (every publish after it raises), or a bucket written
                under a ``plan`` does not hash to its checksum.
        """
        if self._error is not None:
            raise WeightSyncError(f"{type(self).__name__}: its I/O thread died: {self._error!r}") from self._error
        t0 = time.perf_counter()
        with self._publish_lock:
            stats = self._publish(tensors, version, mode=mode, lora_config=lora_config, incarnation=incarnation,
                                  plan=plan)
        return {"version": version, **stats, "publish_s": time.perf_counter() - t0}

    @abc.abstractmethod
    def _publish(self, tensors: Mapping[str, torch.Tensor], version: int, *, mode: WeightMode,
                 lora_config: dict[str, Any] | None, incarnation: str,
                 plan: Sequence[Bucket] | None = None) -> dict[str, Any]:
        """The backend's part of :meth:`publish`, under its lock: checks the call (``_staging.check_publish``, or
        ``plan_publish`` with the ``plan``), writes the version and sets ``_last_version``; returns ``bytes``,
        ``buckets`` and its own timings. A backend that cannot follow a ``plan`` raises ``ValueError`` for one."""

    @abc.abstractmethod
    def committed(self) -> dict[str, int]:
        """The version each receiver reported as applied, by receiver id."""

    @abc.abstractmethod
    def close(self) -> None: ...


class WeightReceiver(abc.ABC):
    """Worker end: stages the newest version in the background; the worker applies it at a safe point."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def poll(self) -> WeightUpdate | None:
        """The newest fully staged and verified version newer than the last committed one, or None."""

    @abc.abstractmethod
    def wait(self, version: int, timeout: float, *, incarnation: str | None = None) -> WeightUpdate | None:
        """Blocks until a version ``>= version`` (of ``incarnation``, if given) is staged (or ``timeout``);
        returns it or None."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Reports that the engine now runs ``version`` (phase two)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: versions staged/committed, failures with reasons, bytes, seconds."""

    @abc.abstractmethod
    def close(self) -> None: ...
