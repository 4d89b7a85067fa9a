"""Test-side helpers for the weight backends: small versioned weights, and fault injection (kept out of the
production classes)."""

from __future__ import annotations

from typing import Any

import torch

KB = 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    """Eight 16 KiB tensors (8 buckets of 16 KiB), every value telling the version and the tensor."""
    return {f"w{i}": torch.full((4 * KB,), float(version * 100 + i)) for i in range(8)}


def is_version(tensors: dict[str, torch.Tensor], version: int) -> bool:
    want = weights(version)
    return list(tensors) == list(want) and all(torch.equal(tensors[k], want[k]) for k in want)


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
