"""The bucket checksum and the copies it is fused with (private to the weight backends).

The checksum is xxh3-64 (``xxhash``; SIMD, ~13 GB/s a core here, against ~2.8 GB/s for ``zlib.crc32``,
which took 62-77 % of a sync's samples). ``google_crc32c`` was the other candidate: its C API takes only
``bytes`` (``y#``), so hashing a buffer in place would first copy it.

A full pass over a bucket to hash it after copying it would read it from memory twice. Here every copy
into a bucket goes in pieces of ``CHUNK`` bytes and each piece is hashed right after it is written, while
it is still in cache: the hash costs cache bandwidth, not memory bandwidth. Streaming updates give the
same digest as one call over the whole buffer, so either end may hash in pieces or at once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch
import xxhash

from asyncrl.weights.base import Bucket, bucket_checksum

__all__ = ["CHUNK", "checksum", "copy_checksum", "fill_bucket", "scatter_bucket"]

CHUNK = 1 << 20
"""Bytes copied, then hashed while hot; 1 MiB fits the L2 of current server cores."""


checksum = bucket_checksum
"""xxh3-64 of a buffer's bytes (nothing is copied)."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _copy_hash(h: xxhash.xxh3_64, dst: memoryview, dst_ptr: int, src_ptr: int, n: int) -> None:
    for o in range(0, n, CHUNK):
        k = min(CHUNK, n - o)
        ctypes.memmove(dst_ptr + o, src_ptr + o, k)
        h.update(dst[o : o + k])


def _hash(h: xxhash.xxh3_64, data: memoryview) -> None:
    for o in range(0, data.nbytes, CHUNK):
        h.update(data[o : o + CHUNK])


def fill_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> int:
    """Copies the bucket's tensors into ``out`` (CPU uint8, ``bucket.nbytes`` long, contiguous) at their offsets,
    padding zeroed, and returns the checksum of ``out`` computed piece by piece as it is written.

    A contiguous CPU tensor is copied byte for byte; any other (strided, on a GPU) in one ``copy_`` into its
    place, then hashed in pieces.
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
                _copy_hash(h, dst, base + slot.offset, src.data_ptr(), slot.nbytes)
            else:
                out[slot.offset : slot.offset + slot.nbytes].view(src.dtype).view(src.shape).copy_(src)
                _hash(h, dst)
        end = slot.offset + slot.nbytes
    if end < bucket.nbytes:
        out[end:].zero_()
        h.update(mv[end:])
    return h.intdigest()


def scatter_bucket(bucket: Bucket, src: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> int:
    """The reverse of :func:`fill_bucket`: copies each of the bucket's tensors out of ``src`` (the bucket's bytes,
    CPU uint8, ``bucket.nbytes`` long) into ``tensors[name]`` (CPU, contiguous, as many bytes), and returns the
    checksum of the bucket: each tensor's bytes hashed piece by piece right after they land in their destination
    (so what is verified is what the destination holds), the padding between them hashed in ``src``.

    Tied names (one destination tensor under two names) are written twice, each write hashed as it lands.
    """
    h = xxhash.xxh3_64()
    mv, base = _as_bytes(src), src.data_ptr()
    end = 0
    for slot in bucket.slots:
        if slot.offset > end:
            h.update(mv[end : slot.offset])
        if slot.nbytes:
            dst = tensors[slot.name]
            if dst.device.type != "cpu" or not dst.is_contiguous() or dst.nbytes != slot.nbytes:
                raise ValueError(f"scatter_bucket: {slot.name} needs {slot.nbytes} contiguous CPU bytes, the destination "
                                 f"is {dst.dtype}{list(dst.shape)} on {dst.device}")
            _copy_hash(h, _as_bytes(dst.view(-1).view(torch.uint8)), dst.data_ptr(), base + slot.offset, slot.nbytes)
        end = slot.offset + slot.nbytes
    if end < bucket.nbytes:
        h.update(mv[end:])
    return h.intdigest()


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
