"""Delta updates (``weights.delta: true``): one bucket sent as its difference from the receiver's base.

After one optimizer step most weights keep their bit pattern, or change in the low mantissa bits only
(bf16 after one AdamW step at lr 1e-6: ~2 % of the elements change; see ``benchmarks/weight_delta.py``).
A bucket of version ``v`` can then travel as a :class:`BucketDelta` against the *base*, the same bucket
of a version ``(base_incarnation, base_version)`` that the receiver has committed::

    broadcaster: x = new XOR base (bit patterns, as words of the bucket's smallest element width)
        sparse: the changed words' positions (gaps, byte-shuffled) + their XOR values, zstd
        xor:    x itself, zstd (chosen for dense changes, where positions cost more than zeros)
        neither smaller than the bucket -> encode() returns None: send the full bucket
    receiver: check the base is the one held -> result = base XOR x -> check the result's checksum

The delta carries the base it was made against and the checksum of the *result* (the bucket's checksum,
:func:`asyncrl.weights.base.bucket_checksum`, which the zmq BUCKET message also carries). :meth:`DeltaCodec.decode`
refuses, with a :class:`DeltaRefused` whose ``reason`` is one of :data:`REFUSALS`, a delta whose base
the receiver does not hold (``base_mismatch``: a late joiner, a skipped version, a rolled-back
incarnation, a receiver that lied about its base), whose payload is malformed (``malformed``) or whose
result does not match the checksum (``checksum_mismatch``: the receiver's base bytes differ from the
broadcaster's). The backends count refusals by reason and heal by fetching that bucket in full.

The backends' two ends: :func:`encode_bucket` (broadcaster) and :func:`apply_bucket` (receiver), and
:class:`DeltaBase`, the receiver's committed buckets. Where they plug in: ``asyncrl.weights.zmq`` (a GET names
the receiver's base, a BUCKET may carry a ``delta`` header with the payload as its data frame). Not in
``asyncrl.weights.shm``: its receivers verify and load the shared segment in place, so no bytes per receiver
are there to save.

Who blocks on what: a :class:`DeltaCodec` never blocks and owns reusable zstd contexts and scratch
buffers, so each thread that encodes or decodes uses its own codec (each of the broadcaster's encoder
threads, each receiver's I/O thread); :class:`DeltaBase` takes a short lock. Encoding costs one compare
pass over new and base plus zstd of what changed; decoding one copy of the base plus a scatter of what
changed (sparse), or a zstd decompression and an XOR (xor), then the result's checksum. The compare and
the scatter run as compiled single-pass kernels (:mod:`asyncrl.weights._delta_kernels`, numba: ~3x the
vectorised numpy path, which is the fallback without numba and for changes too dense for the kernels'
scratch) with the same output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import zstandard

from asyncrl.weights import _delta_kernels as kernels
from asyncrl.weights.base import Bucket, bucket_checksum

__all__ = [
    "REFUSALS",
    "BucketDelta",
    "DeltaBase",
    "DeltaCodec",
    "DeltaRefused",
    "apply_bucket",
    "delta_word",
    "encode_bucket",
    "same_layout",
]

Encoding = Literal["sparse", "xor"]
ENCODINGS: tuple[Encoding, ...] = ("sparse", "xor")
REFUSALS = ("base_mismatch", "malformed", "checksum_mismatch")
"""Why :meth:`DeltaCodec.decode` refused a delta (the ``reason`` of :class:`DeltaRefused`)."""
XOR_DENSITY = 0.05
"""The xor encoding is also tried when more than this fraction of the words changed. Measured
(``benchmarks/weight_delta.py --densities``): sparse is smaller than xor at every density up to
50 % for 2- and 4-byte words, and cheaper; xor is the fallback for dense changes."""
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
KERNEL_DENSITY = 1 / 16
"""The compiled compare keeps scratch for this fraction of a bucket's words changed (6 bytes a changed bf16
word: 4 MiB for a 64 MiB bucket); above it, encode() goes the numpy way."""


class DeltaRefused(ValueError):
    """A delta the receiver cannot apply; ``reason`` is one of :data:`REFUSALS`. Fetch the full bucket."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BucketDelta:
    """One bucket as a delta against ``(base_incarnation, base_version)``; ``payload`` is what travels."""

    encoding: Encoding
    base_version: int
    base_incarnation: str
    word: int
    """Element width in bytes the bucket was compared in (its smallest dtype's itemsize)."""
    nbytes: int
    """Size of the result (the full bucket)."""
    checksum: int
    """Checksum of the result (:func:`~asyncrl.weights.base.bucket_checksum`)."""
    count: int
    """``sparse``: words changed; ``xor``: 0."""
    split: int
    """``sparse``: payload bytes of the compressed positions (the XOR values follow); ``xor``: 0."""
    payload: np.ndarray
    """uint8, the compressed bytes."""

    @property
    def wire_nbytes(self) -> int:
        return int(self.payload.nbytes)

    def header(self) -> dict[str, Any]:
        """Everything but the payload, for a manifest or a message body (msgpack/JSON-safe)."""
        return {"encoding": self.encoding, "base_version": self.base_version,
                "base_incarnation": self.base_incarnation, "word": self.word, "nbytes": self.nbytes,
                "checksum": self.checksum, "count": self.count, "split": self.split}

    @classmethod
    def from_wire(cls, header: Any, payload: np.ndarray) -> BucketDelta:
        """Parses a peer's header (raises :class:`DeltaRefused` ``malformed``); ``payload`` is uint8."""
        try:
            h = dict(header)
            d = cls(encoding=h["encoding"], base_version=h["base_version"], base_incarnation=h["base_incarnation"],
                    word=h["word"], nbytes=h["nbytes"], checksum=h["checksum"], count=h["count"], split=h["split"],
                    payload=payload)
        except (KeyError, TypeError, ValueError) as e:
            raise DeltaRefused("malformed", f"malformed delta header {header!r:.200}: {e}") from e
        ints = (d.base_version, d.word, d.nbytes, d.checksum, d.count, d.split)
        if (d.encoding not in ENCODINGS or not isinstance(d.base_incarnation, str) or len(d.base_incarnation) > 64
                or not all(type(i) is int and i >= 0 for i in ints) or d.word not in _WORDS or d.nbytes % d.word
                or not 0 <= d.split <= payload.nbytes or d.count > d.nbytes // d.word):
            raise DeltaRefused("malformed", f"malformed delta header {header!r:.200} "
                                            f"(payload {payload.nbytes} bytes)")
        return d


def delta_word(bucket: Bucket) -> int:
    """The element width a bucket is compared in: the smallest itemsize among its tensors (1, 2, 4 or 8)
    that divides the bucket's size (bf16 and fp32 tensors in one bucket compare as 2-byte words)."""
    from asyncrl.weights._staging import DTYPES  # lazily: _staging imports base, as this module does

    sizes = [DTYPES[s.dtype].itemsize for s in bucket.slots if s.nbytes] or [1]
    word = min(min(sizes), 8)
    while word > 1 and bucket.nbytes % word:
        word //= 2
    return word


def same_layout(a: Bucket, b: Bucket) -> bool:
    """Whether bucket ``b`` of a base version holds the same tensors at the same offsets as ``a``."""
    return a.nbytes == b.nbytes and a.to_wire()["slots"] == b.to_wire()["slots"]


def _changed(new: np.ndarray, base: np.ndarray, word: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in words) and XOR values of the words that differ between two uint8 buffers: first the
    8-byte blocks that differ (one compare pass, no XOR written: numpy's nonzero is fastest on a bool mask),
    then the words inside those. ~5x faster than ``np.flatnonzero(new ^ base)`` at one optimizer step's
    sparsity."""
    wt = _WORDS[word]
    per = 8 // word
    if per == 1 or new.nbytes % 8:
        a, b = new.view(wt), base.view(wt)
        positions = np.flatnonzero(a != b)
        return positions, a[positions] ^ b[positions]
    a, b = new.view(np.uint64), base.view(np.uint64)
    blocks = np.flatnonzero(a != b)
    words = (a[blocks] ^ b[blocks]).view(wt)
    inner = np.flatnonzero(words)
    return blocks[inner // per] * per + inner % per, words[inner]


def _shuffle(a: np.ndarray) -> np.ndarray:
    """Byte planes (all first bytes, then all second bytes...): small numbers compress far better."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).reshape(-1)


def _unshuffle(b: np.ndarray, dtype: type) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    return np.ascontiguousarray(b.reshape(itemsize, -1).T).reshape(-1).view(dtype)


class DeltaCodec:
    """Encodes and decodes bucket deltas, reusing zstd contexts and a scratch buffer (one per thread).

    Args:
        level: zstd level (1: fastest of the ordinary levels; measured ratios barely improve above it).
        threads: zstd worker threads for the dense ``xor`` encoding (0: in the calling thread).
    """

    def __init__(self, *, level: int = 1, threads: int = 0):
        self.level = level
        self._cctx = zstandard.ZstdCompressor(level=level, threads=threads)
        self._dctx = zstandard.ZstdDecompressor()
        self._scratch = np.empty(0, dtype=np.uint8)
        self._gaps = np.empty(0, dtype=np.uint32)
        self._values: dict[int, np.ndarray] = {}

    def _xor(self, new: np.ndarray, base: np.ndarray, word: int) -> np.ndarray:
        if self._scratch.nbytes < new.nbytes:
            self._scratch = np.empty(new.nbytes, dtype=np.uint8)
        wt = _WORDS[word]
        out = self._scratch[: new.nbytes].view(wt)
        np.bitwise_xor(new.view(wt), base.view(wt), out=out)
        return out

    # -- broadcaster ---------------------------------------------------------------------------
    def encode(self, new: np.ndarray, base: np.ndarray, *, word: int, base_version: int, base_incarnation: str,
               checksum: int | None = None) -> BucketDelta | None:
        """The delta turning ``base`` into ``new`` (both uint8, same size), or None if the full bucket
        is not larger. ``checksum`` is ``new``'s (computed here if not given)."""
        if new.dtype != np.uint8 or base.dtype != np.uint8 or new.shape != base.shape or new.ndim != 1:
            raise ValueError(f"new and base must be 1-d uint8 arrays of one size, got {new.dtype}{new.shape} "
                             f"and {base.dtype}{base.shape}")
        if word not in _WORDS or new.nbytes % word:
            raise ValueError(f"{word=} must be 1, 2, 4 or 8 and divide the bucket's {new.nbytes} bytes")
        if checksum is None:
            checksum = bucket_checksum(memoryview(new))
        meta: dict[str, Any] = {"base_version": base_version, "base_incarnation": base_incarnation, "word": word,
                                "nbytes": new.nbytes, "checksum": checksum}
        best: BucketDelta | None = None
        gaps, values = self._changes(new, base, word)
        nwords, count = new.nbytes // word, values.size
        if count * 2 <= nwords < 2**32:
            z_gaps = self._cctx.compress(_shuffle(gaps)) if count else b""
            z_vals = self._cctx.compress(_shuffle(values)) if count else b""
            payload = np.frombuffer(z_gaps + z_vals, dtype=np.uint8).copy()  # writable: torch.from_numpy
            best = BucketDelta(encoding="sparse", count=int(count), split=len(z_gaps), payload=payload, **meta)
        if count > XOR_DENSITY * nwords:
            z = self._cctx.compress(self._xor(new, base, word).view(np.uint8))
            if best is None or len(z) < best.wire_nbytes:
                best = BucketDelta(encoding="xor", count=0, split=0, payload=np.frombuffer(z, dtype=np.uint8).copy(),
                                   **meta)
        return best if best is not None and best.wire_nbytes < new.nbytes else None

    def _changes(self, new: np.ndarray, base: np.ndarray, word: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Gaps between the changed words' positions (uint32; the first is the first position; None for a
        bucket of 2**32 words or more) and their XOR values: the compiled kernel into this codec's scratch,
        or numpy when it is not available or more than ``KERNEL_DENSITY`` of the words changed."""
        nwords, wt = new.nbytes // word, _WORDS[word]
        if nwords < 2**32 and kernels.available():
            cap = max(int(nwords * KERNEL_DENSITY), 1024)
            if self._gaps.size < cap:
                self._gaps = np.empty(cap, dtype=np.uint32)
            if self._values.get(word, np.empty(0)).size < cap:
                self._values[word] = np.empty(cap, dtype=wt)
            k = kernels.changed_gaps(new, base, wt, self._gaps[:cap], self._values[word][:cap])
            if k >= 0:
                return self._gaps[:k], self._values[word][:k]
        positions, values = _changed(new, base, word)
        gaps = np.diff(positions.astype(np.uint32), prepend=np.uint32(0)) if nwords < 2**32 else None
        return gaps, values

    # -- receiver ------------------------------------------------------------------------------
    def decode(self, delta: BucketDelta, base: np.ndarray, *, base_version: int | None, base_incarnation: str,
               out: np.ndarray | None = None) -> np.ndarray:
        """Applies ``delta`` to ``base`` (the bytes of ``(base_incarnation, base_version)`` the receiver
        holds) into ``out`` (uint8, may not alias ``base``; allocated if None) and verifies the result.

        Raises:
            DeltaRefused: ``base_mismatch``, ``malformed`` or ``checksum_mismatch``; ``out`` then holds
                garbage and must not be used.
        """
        if base_version != delta.base_version or base_incarnation != delta.base_incarnation:
            raise DeltaRefused("base_mismatch", f"delta against version {delta.base_version} of incarnation "
                                                f"{delta.base_incarnation!r}, the receiver holds {base_version} of "
                                                f"{base_incarnation!r}")
        if base.nbytes != delta.nbytes:
            raise DeltaRefused("base_mismatch", f"delta of a {delta.nbytes}-byte bucket, the base has {base.nbytes}")
        out = np.empty(delta.nbytes, dtype=np.uint8) if out is None else out[: delta.nbytes]
        if out.nbytes != delta.nbytes:
            raise ValueError(f"out has {out.nbytes} bytes, the delta makes {delta.nbytes}")
        wt = _WORDS[delta.word]
        if delta.encoding == "sparse":
            self._apply_sparse(delta, base, out.view(wt))
        else:
            x = self._decompress(delta.payload, delta.nbytes, "xor payload")
            np.bitwise_xor(base.view(wt), x.view(wt), out=out.view(wt))
        got = bucket_checksum(memoryview(out))
        if got != delta.checksum:
            raise DeltaRefused("checksum_mismatch", f"delta against version {delta.base_version} gave checksum "
                                                    f"{got:#x}, the broadcaster's is {delta.checksum:#x} "
                                                    "(the base bytes differ)")
        return out

    def _apply_sparse(self, delta: BucketDelta, base: np.ndarray, out_words: np.ndarray) -> None:
        """``out = base``, then the sparse delta's XOR values scattered in (the compiled kernel reads the gaps and
        values as the byte planes they travel in; numpy un-shuffles them first)."""
        n = delta.count
        if n == 0 and delta.payload.nbytes:
            raise DeltaRefused("malformed", f"sparse delta of 0 words carries {delta.payload.nbytes} bytes")
        gaps = self._decompress(delta.payload[: delta.split], 4 * n, "positions") if n else None
        values = self._decompress(delta.payload[delta.split :], delta.word * n, "values") if n else None
        np.copyto(out_words.view(np.uint8), base)
        if not n:
            return
        if kernels.available():
            bad = kernels.scatter_planes(out_words, gaps.reshape(4, n), values.reshape(delta.word, n))
        else:
            bad = _scatter_numpy(out_words, _unshuffle(gaps, np.uint32), _unshuffle(values, _WORDS[delta.word]))
        if bad >= 0:
            raise DeltaRefused("malformed", f"sparse delta positions not increasing or beyond the bucket's "
                                            f"{out_words.size} words (at change {bad} of {n})")

    def _decompress(self, data: np.ndarray, nbytes: int, what: str) -> np.ndarray:
        try:
            size = zstandard.frame_content_size(data)
            if size != nbytes:  # also refuses a frame that would inflate beyond what was announced
                raise DeltaRefused("malformed", f"delta {what}: zstd frame of {size} bytes, expected {nbytes}")
            return np.frombuffer(self._dctx.decompress(data, max_output_size=nbytes), dtype=np.uint8)
        except zstandard.ZstdError as e:
            raise DeltaRefused("malformed", f"delta {what}: {e}") from e


def _scatter_numpy(words: np.ndarray, gaps: np.ndarray, values: np.ndarray) -> int:
    """``words[p] ^= value`` at the positions the gaps give (numpy); returns -1, or 0 (nothing applied) for
    positions that do not increase or go beyond ``words``."""
    positions = np.cumsum(gaps, dtype=np.int64)
    if gaps[1:].min(initial=1) == 0 or positions[-1] >= words.size:
        return 0
    words[positions] ^= values
    return -1


# -- the backends' two ends ------------------------------------------------------------------------
def _u8(data: torch.Tensor | np.ndarray) -> np.ndarray:
    return data.numpy() if isinstance(data, torch.Tensor) else data


def encode_bucket(codec: DeltaCodec, bucket: Bucket, data: torch.Tensor | np.ndarray, base_bucket: Bucket | None,
                  base_data: torch.Tensor | np.ndarray | None, *, base_version: int, base_incarnation: str,
                  checksum: int | None = None) -> BucketDelta | None:
    """Broadcaster: ``bucket`` (bytes ``data``, checksum ``checksum``, default ``bucket.checksum``) as a delta
    against the same bucket of a base version, or None (send it full) if the layouts differ or the delta is
    not smaller."""
    if base_bucket is None or base_data is None or not same_layout(bucket, base_bucket) or bucket.nbytes == 0:
        return None
    return codec.encode(_u8(data), _u8(base_data), word=delta_word(bucket), base_version=base_version,
                        base_incarnation=base_incarnation, checksum=bucket.checksum if checksum is None else checksum)


def apply_bucket(codec: DeltaCodec, base: DeltaBase, bucket: Bucket, header: Any, payload: torch.Tensor | np.ndarray,
                 *, checksum: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Receiver: the bytes of ``bucket`` (from a verified manifest) rebuilt from a peer's delta against
    the receiver's base, in ``out`` (uint8, ``bucket.nbytes``; allocated if None).

    Args:
        checksum: the result's checksum as the broadcaster announced it apart from the delta (the
            manifest's, or the bucket message's); default ``bucket.checksum``; 0 or None: only the
            delta's own.

    Raises:
        DeltaRefused: the base is not held or has another layout (``base_mismatch``), the header or
            payload is malformed or names another checksum than the broadcaster (``malformed``), or the
            result fails the checksum (``checksum_mismatch``). Fetch the bucket in full.
    """
    payload = _u8(payload)
    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise DeltaRefused("malformed", f"delta payload is {payload.dtype}{list(payload.shape)}, not 1-d uint8")
    delta = BucketDelta.from_wire(header, payload)
    expected = bucket.checksum if checksum is None else checksum
    if delta.nbytes != bucket.nbytes or (expected and delta.checksum != expected):
        raise DeltaRefused("malformed", f"delta of {delta.nbytes} bytes, checksum {delta.checksum:#x}; bucket "
                                        f"{bucket.index} has {bucket.nbytes}, checksum {expected:#x}")
    version, incarnation, base_data = base.bucket(bucket)
    if base_data is None:
        raise DeltaRefused("base_mismatch", f"no base for bucket {bucket.index} (holding version {version} of "
                                            f"{incarnation!r}, whose bucket has another layout or none)")
    out = torch.empty(bucket.nbytes, dtype=torch.uint8) if out is None else out
    codec.decode(delta, base_data, base_version=version, base_incarnation=incarnation, out=out.numpy())
    return out


class DeltaBase:
    """Receiver: the bucket bytes of one version it verified and committed: the base deltas are made against.
    Costs one set of receive buffers (one copy of the weights) held back from reuse.

    The backend hands a staged update's buffers here when the staging area releases them
    (:meth:`release`): buffers of the version just committed become the base and the previous base's
    buffers go back to the backend's pool; any others go back at once. The I/O thread reads the base
    (:meth:`key`, :meth:`bucket`) while decoding. The base's bytes are never written while it is the base
    (a decode writes into a transfer's own buffers), and its identity is always that of its bytes, so a
    base is never wrong, at worst absent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: tuple[int, str, list[Bucket], list[torch.Tensor], Callable[[], None]] | None = None

    def release(self, version: int, incarnation: str, buckets: list[Bucket], buffers: list[torch.Tensor],
                give_back: Callable[[], None], *, committed: bool) -> None:
        """A staged update of ``(incarnation, version)`` in ``buffers`` is unused now. ``committed``: it is
        the version the engine runs, so it becomes the base (the previous base is given back); otherwise
        ``give_back()`` is called at once."""
        if not committed:
            give_back()
            return
        with self._lock:
            old, self._base = self._base, (version, incarnation, buckets, buffers, give_back)
        if old is not None:
            old[4]()

    def key(self) -> tuple[int | None, str]:
        """``(version, incarnation)`` of the base, ``(None, "")`` without one."""
        with self._lock:
            return (None, "") if self._base is None else (self._base[0], self._base[1])

    def bucket(self, bucket: Bucket) -> tuple[int | None, str, np.ndarray | None]:
        """The base's version, incarnation and bytes of the bucket laid out like ``bucket`` (None if not)."""
        with self._lock:
            if self._base is None:
                return None, "", None
            version, incarnation, buckets, buffers, _ = self._base
        if bucket.index < len(buckets) and same_layout(bucket, buckets[bucket.index]):
            return version, incarnation, buffers[bucket.index].numpy()
        return version, incarnation, None

    def drop(self) -> None:
        """Forgets the base (its buffers are given back): every bucket comes full until the next commit."""
        with self._lock:
            old, self._base = self._base, None
        if old is not None:
            old[4]()
