"""Test-side fault injection for the weight backends (kept out of the production classes)."""

from __future__ import annotations

from typing import Any


def corrupt_next(b: Any, bucket_index: int) -> None:
    """The next version ``b`` (a zmq or shm broadcaster) publishes has one byte of bucket ``bucket_index``
    flipped after its checksum was computed, so every read of that version fails (retries too); the version
    after it is clean. Works through the broadcasters' per-bucket write, ``_fill``."""
    real = b._fill

    def fill(bucket, tensors, out):
        value = real(bucket, tensors, out)
        if bucket.index == bucket_index:
            out[out.numel() // 2] ^= 0xFF
            b._fill = real
        return value

    b._fill = fill
