"""Compiled single-pass kernels for :mod:`asyncrl.weights.delta` (private; numba, optional).

Why: the vectorised numpy encode makes five passes (compare, nonzero, gather, the words inside the
changed 8-byte blocks, gaps) and runs at ~1.2 GB/s a core, the decode's scatter at ~6 GB/s; over
loopback a full bucket costs about as much CPU, so deltas could not be faster there. These kernels do
the compare, the positions and the gaps in one pass over the two buffers (~4 GB/s here, memory-bound)
and the scatter with its bounds checks in one pass over the changes, reading the gaps and values in the
byte planes they travel in (un-shuffling them first cost as much as the scatter). They produce exactly
what the numpy path produces (tests compare them), so either end may use either.

numba is imported, and the kernels compiled, at the first call (``available()``; ~1.5 s each, cached on
disk under numba's cache directory after that, holding the GIL while it compiles); without numba, or
on a big-endian machine, ``available()`` is False and :mod:`~asyncrl.weights.delta` uses numpy. The
kernels release the GIL (``nogil``) and touch only the arrays they are given.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

__all__ = ["available", "changed_gaps", "scatter_planes", "warm"]

_lock = threading.Lock()
_kernels: dict[str, Any] | None = None
_failed = False


def _compile() -> dict[str, Any]:
    import numba

    jit = numba.njit(nogil=True, cache=True, boundscheck=False)

    @jit
    def blocks(a, b, bits, per, gaps, vals):  # a, b: uint64 blocks of `per` words of `bits` bits
        mask = np.uint64((1 << bits) - 1)
        k, last, cap = 0, 0, gaps.size
        for i in range(a.size):
            x = a[i] ^ b[i]
            if x:
                for j in range(per):
                    w = (x >> np.uint64(bits * j)) & mask
                    if w:
                        if k == cap:
                            return -1
                        p = i * per + j
                        gaps[k] = p - last
                        vals[k] = w
                        last = p
                        k += 1
        return k

    @jit
    def words(a, b, gaps, vals):  # a, b: the words themselves
        k, last, cap = 0, 0, gaps.size
        for i in range(a.size):
            x = a[i] ^ b[i]
            if x:
                if k == cap:
                    return -1
                gaps[k] = i - last
                vals[k] = x
                last = i
                k += 1
        return k

    @jit
    def scatter_planes(out, gp, vp):  # gaps and values as byte planes (rows), as they travel; unrolled by width
        p, n, vb = np.uint64(0), out.size, vp.shape[0]
        s8, s16, s24 = np.uint64(8), np.uint64(16), np.uint64(24)
        for k in range(gp.shape[1]):
            g = (np.uint64(gp[0, k]) | (np.uint64(gp[1, k]) << s8) | (np.uint64(gp[2, k]) << s16)
                 | (np.uint64(gp[3, k]) << s24))
            if k > 0 and g == 0:
                return k
            p += g
            if p >= n:
                return k
            v = np.uint64(vp[0, k])
            if vb >= 2:
                v |= np.uint64(vp[1, k]) << s8
            if vb >= 4:
                v |= (np.uint64(vp[2, k]) << s16) | (np.uint64(vp[3, k]) << s24)
            if vb == 8:
                v |= ((np.uint64(vp[4, k]) << np.uint64(32)) | (np.uint64(vp[5, k]) << np.uint64(40))
                      | (np.uint64(vp[6, k]) << np.uint64(48)) | (np.uint64(vp[7, k]) << np.uint64(56)))
            out[p] ^= v
        return -1

    return {"blocks": blocks, "words": words, "scatter_planes": scatter_planes}


def available() -> bool:
    """Whether the kernels can run here (numba importable, little-endian); compiles them on the first call."""
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels is not None
    with _lock:
        if _kernels is None and not _failed:
            if sys.byteorder != "little":  # positions inside a block follow the numpy views' little-endian order
                _failed = True
            else:
                try:
                    _kernels = _compile()
                except ImportError:  # optional dependency: the numpy path is used
                    _failed = True
    return _kernels is not None


def warm() -> None:
    """Imports numba and compiles (or loads from numba's disk cache) the kernels for every word width, so that the
    first delta does not pay for it (a broadcaster and a receiver with deltas call it in a thread of their own at
    start-up; ~2 s once numba's cache is filled, several the first time on a machine)."""
    if not available():
        return
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        gaps, values, data = np.zeros(4, np.uint32), np.zeros(4, dtype), np.zeros(16, np.uint8)
        changed_gaps(data, data.copy(), dtype, gaps, values)
        changed_gaps(data[:8 + np.dtype(dtype).itemsize], data[:8 + np.dtype(dtype).itemsize].copy(), dtype, gaps,
                     values)  # not a multiple of 8 bytes (uint8: 9): the words kernel
        scatter_planes(data.view(dtype), np.zeros((4, 1), np.uint8), np.zeros((np.dtype(dtype).itemsize, 1), np.uint8))


def changed_gaps(new: np.ndarray, base: np.ndarray, word_dtype: type, gaps: np.ndarray, values: np.ndarray) -> int:
    """Gaps between the positions (in words) of the words that differ between two uint8 buffers, and their XOR
    values, written into ``gaps`` (uint32) and ``values`` (``word_dtype``); returns how many, or -1 when more
    than ``gaps.size`` differ (nothing useful is written then). The first gap is the first position."""
    assert _kernels is not None
    itemsize = np.dtype(word_dtype).itemsize
    if itemsize < 8 and new.nbytes % 8 == 0:
        return int(_kernels["blocks"](new.view(np.uint64), base.view(np.uint64), 8 * itemsize, 8 // itemsize,
                                      gaps, values))
    return int(_kernels["words"](new.view(word_dtype), base.view(word_dtype), gaps, values))


def scatter_planes(out_words: np.ndarray, gap_planes: np.ndarray, value_planes: np.ndarray) -> int:
    """``out_words[p] ^= value`` at the positions the gaps give, the gaps and values given as their byte planes
    (uint8 arrays of shape ``(itemsize, count)``, least significant byte first: the byte-shuffled form they travel
    in), read in place. Returns -1, or the index of the first gap that is 0 after the first or leads beyond
    ``out_words`` (what came before it was applied)."""
    assert _kernels is not None
    return int(_kernels["scatter_planes"](out_words, gap_planes, value_planes))
