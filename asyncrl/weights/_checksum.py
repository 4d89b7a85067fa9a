"""The bucket checksum and the copies it is fused with (private to the weight backends).

The checksum is xxh3-64 (``xxhash``; SIMD, ~13 GB/s a core here, against ~2.8 GB/s for ``zlib.crc32``,
which took 62-77 % of a sync's samples). ``google_crc32c`` was the other candidate: its C API takes only
``bytes`` (``y#``), so hashing a buffer in place would first copy it.

A full pass over a bucket to hash it after copying it would read it from memory twice. Here every copy
into a bucket goes in pieces of ``CHUNK`` bytes and each piece is hashed right after it is written, while
it is still in cache: the hash costs cache bandwidth, not memory bandwidth. Streaming updates give the
same digest as one call over the whole buffer, so either end may hash in pieces or at once.

Progress: :func:`fill_bucket` can report, after each piece, how many leading bytes of the bucket are final, and
:class:`BucketScatter` copies a bucket out in as many steps as the bytes arrive, so a reader can trail the writer
by a piece inside one bucket (a large tensor is a bucket of its own) and finish the bucket as soon as it is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping

import torch
import xxhash

from asyncrl.weights.base import Bucket, bucket_checksum

__all__ = ["CHUNK", "BucketScatter", "checksum", "copy_checksum", "fill_bucket", "scatter_bucket"]

CHUNK = 1 << 20
"""Bytes copied, then hashed while hot; 1 MiB fits the L2 of current server cores."""


checksum = bucket_checksum
"""xxh3-64 of a buffer's bytes (nothing is copied)."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _copy_hash(h: xxhash.xxh3_64, dst: memoryview, dst_ptr: int, src_ptr: int, n: int,
               done: Callable[[int], None] | None = None) -> None:
    for o in range(0, n, CHUNK):
        k = min(CHUNK, n - o)
        ctypes.memmove(dst_ptr + o, src_ptr + o, k)
        h.update(dst[o : o + k])
        if done is not None:
            done(o + k)


def _hash(h: xxhash.xxh3_64, data: memoryview) -> None:
    for o in range(0, data.nbytes, CHUNK):
        h.update(data[o : o + CHUNK])


def fill_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                progress: Callable[[int], None] | None = None) -> int:
    """Copies the bucket's tensors into ``out`` (CPU uint8, ``bucket.nbytes`` long, contiguous) at their offsets,
    padding zeroed, and returns the checksum of ``out`` computed piece by piece as it is written.

    A contiguous CPU tensor is copied byte for byte; any other (strided, on a GPU) in one ``copy_`` into its
    place, then hashed in pieces. ``progress(n)``, if given, is called whenever the first ``n`` bytes of ``out`` are
    final (after each piece of a contiguous tensor, after each other tensor, and at the end).
    """
    h = xxhash.xxh3_64()
    mv, base = _as_bytes(out), out.data_ptr()
    end = 0
    for slot in bucket.slots:
        if slot.offset > end:
            out[end : slot.offset].zero_()
            h.update(mv[end : slot.offset])
        if slot.nbytes:
            src = tensors[slot.name].detach()
            dst = mv[slot.offset : slot.offset + slot.nbytes]
            if src.device.type == "cpu" and src.is_contiguous():
                at = None if progress is None else (lambda n, o=slot.offset: progress(o + n))
                _copy_hash(h, dst, base + slot.offset, src.data_ptr(), slot.nbytes, at)
            else:
                out[slot.offset : slot.offset + slot.nbytes].view(src.dtype).view(src.shape).copy_(src)
                _hash(h, dst)
                if progress is not None:
                    progress(slot.offset + slot.nbytes)
        end = slot.offset + slot.nbytes
    if end < bucket.nbytes:
        out[end:].zero_()
        h.update(mv[end:])
    if progress is not None:
        progress(bucket.nbytes)
    return h.intdigest()


class BucketScatter:
    """The reverse of :func:`fill_bucket`, in as many steps as the bytes arrive: :meth:`advance` copies the bucket's
    bytes up to an offset out of ``src`` (the bucket's bytes, CPU uint8, ``bucket.nbytes`` long) into
    ``tensors[name]`` (CPU, contiguous, as many bytes as the slot), and :meth:`digest` is the checksum of the whole
    bucket: each tensor's bytes hashed piece by piece right after they land in their destination (so what is
    verified is what the destination holds), the padding between them hashed in ``src``.

    Tied names (one destination tensor under two names) are written twice, each write hashed as it lands.

    Raises:
        ValueError: a destination that is not ``slot.nbytes`` contiguous CPU bytes.
    """

    def __init__(self, bucket: Bucket, src: torch.Tensor, tensors: Mapping[str, torch.Tensor]):
        self.nbytes = bucket.nbytes
        self.done = 0
        self._h = xxhash.xxh3_64()
        self._src, self._base = _as_bytes(src), src.data_ptr()
        self._parts: list[tuple[int, int, torch.Tensor | None]] = []
        """``(start, end, destination)`` covering the bucket in order; None: padding, hashed in ``src``."""
        end = 0
        for slot in bucket.slots:
            if slot.offset > end:
                self._parts.append((end, slot.offset, None))
            if slot.nbytes:
                dst = tensors[slot.name]
                if dst.device.type != "cpu" or not dst.is_contiguous() or dst.nbytes != slot.nbytes:
                    raise ValueError(f"scatter_bucket: {slot.name} needs {slot.nbytes} contiguous CPU bytes, the "
                                     f"destination is {dst.dtype}{list(dst.shape)} on {dst.device}")
                self._parts.append((slot.offset, slot.offset + slot.nbytes, dst))
            end = max(end, slot.offset + slot.nbytes)
        if end < bucket.nbytes:
            self._parts.append((end, bucket.nbytes, None))
        self._part = 0

    def advance(self, upto: int) -> None:
        """Copies and hashes the bucket's bytes ``[done, upto)`` (``upto`` clipped to the bucket)."""
        upto = min(upto, self.nbytes)
        while self.done < upto and self._part < len(self._parts):
            start, end, dst = self._parts[self._part]
            if end <= self.done:  # overlapping slots (never planned; the checksum then fails): nothing left here
                self._part += 1
                continue
            self.done = max(self.done, start)  # a guard: the parts are contiguous
            stop = min(end, upto)
            if dst is None:
                _hash(self._h, self._src[self.done : stop])
            else:
                rel = self.done - start
                out = _as_bytes(dst.view(-1).view(torch.uint8))
                _copy_hash(self._h, out[rel:], dst.data_ptr() + rel, self._base + self.done, stop - self.done)
            self.done = stop
            if stop == end:
                self._part += 1

    def digest(self) -> int:
        """The bucket's checksum; call once :meth:`advance` reached the end."""
        if self.done < self.nbytes and self._part < len(self._parts):
            raise RuntimeError(f"BucketScatter: digest() at {self.done} of {self.nbytes} bytes")
        return self._h.intdigest()


def scatter_bucket(bucket: Bucket, src: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> int:
    """:class:`BucketScatter` of the whole bucket at once; returns its checksum."""
    scatter = BucketScatter(bucket, src, tensors)
    scatter.advance(bucket.nbytes)
    return scatter.digest()


def copy_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copies ``src`` (CPU, contiguous, as many bytes as ``dst``) into ``dst`` (CPU uint8, contiguous), returning
    the checksum of what was written, hashed piece by piece as it lands."""
    n = dst.numel()
    if src.numel() * src.element_size() != n or not src.is_contiguous() or src.device.type != "cpu":
        raise ValueError(f"copy_checksum: source is {src.dtype}{list(src.shape)} on {src.device}, need {n} "
                         "contiguous CPU bytes")
    h = xxhash.xxh3_64()
    if n:
        _copy_hash(h, _as_bytes(dst), dst.data_ptr(), src.data_ptr(), n)
    return h.intdigest()
