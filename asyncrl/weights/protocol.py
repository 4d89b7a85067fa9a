"""The weight channel's protocol: the manifest both backends publish, the zmq messages, the bucket codec point.

A version travels as a *manifest* (what the version is and how its tensors are packed into buckets) and
its buckets' bytes. The manifest goes first, before the buckets are written, so a receiver fetches and
verifies bucket ``i`` while the broadcaster still writes ``i + 1``; each bucket's checksum
(:func:`~asyncrl.weights.base.bucket_checksum`, over the bucket's bytes) therefore travels with the
bucket, not in the manifest: in the BUCKET message (zmq) or the segment's header (shm).

zmq messages (every body a msgpack map checked by :func:`check_message`; a violation is a
:class:`~asyncrl.codec.DecodeError`)::

    receiver                                 broadcaster
    WANT {receiver_id, have, committed}  ──► MANIFEST {manifest fields} | NONE
    GET {version, index}  (≤ window)     ──► BUCKET {version, index, checksum, <bucket fields>}
                                             | GONE {version, index}
    COMMIT {receiver_id, version}        ──► (recorded; committed() reports it)
                                         ◄── ANNOUNCE {version}  (on publish, to every receiver seen)

``<bucket fields>`` are what :func:`encode_bucket` makes of a bucket's bytes and :func:`decode_bucket`
turns back into them: the one place where a bucket becomes wire bytes, where a delta encoding
(:mod:`asyncrl.weights.delta`) plugs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import NoneType
from typing import Any

import torch

from asyncrl.codec import TENSOR_DTYPES, DecodeError
from asyncrl.transport.protocol import check_fields
from asyncrl.weights._checksum import copy_checksum
from asyncrl.weights.base import Bucket, TensorSlot, WeightMode

__all__ = [
    "ANNOUNCE",
    "BROADCASTER_KINDS",
    "BUCKET",
    "COMMIT",
    "GET",
    "GONE",
    "MANIFEST",
    "MODES",
    "Manifest",
    "NONE",
    "RECEIVER_KINDS",
    "WANT",
    "buckets_from_wire",
    "check_checksum",
    "check_message",
    "decode_bucket",
    "encode_bucket",
]

MODES = ("full", "lora")
MAX_INCARNATION_CHARS = 64
CHECKSUM_LIMIT = 2**64

WANT, GET, COMMIT = "w_want", "w_get", "w_commit"
MANIFEST, NONE, BUCKET, GONE, ANNOUNCE = "w_manifest", "w_none", "w_bucket", "w_gone", "w_announce"
RECEIVER_KINDS = frozenset({WANT, GET, COMMIT})
"""Kinds a broadcaster accepts from receivers."""
BROADCASTER_KINDS = frozenset({MANIFEST, NONE, BUCKET, GONE, ANNOUNCE})
"""Kinds a receiver accepts from a broadcaster."""
_OPT_INT = (int, NoneType)
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    WANT: {"receiver_id": str, "have": _OPT_INT, "committed": _OPT_INT},  # + optional "have_incarnation": str
    GET: {"version": int, "index": int},
    COMMIT: {"receiver_id": str, "version": int},
    MANIFEST: {"version": int, "mode": str, "lora_config": (dict, NoneType), "nbytes": int, "buckets": list},
    NONE: {},
    BUCKET: {"version": int, "index": int, "checksum": int},
    GONE: {"version": int, "index": int},
    ANNOUNCE: {"version": int},
}


def check_message(kind: str, body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """Checks kind and body fields of a peer's message; raises DecodeError naming the field."""
    return check_fields(kind, body, allowed, _REQUIRED, "weight message")


@dataclass(kw_only=True, slots=True)
class Manifest:
    """One version as announced: what it is and its bucket layout (checksums travel with the buckets)."""

    version: int
    incarnation: str
    mode: WeightMode
    lora_config: dict[str, Any] | None
    buckets: list[Bucket]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "incarnation": self.incarnation, "mode": self.mode,
                "lora_config": self.lora_config, "nbytes": self.nbytes, "buckets": [b.to_wire() for b in self.buckets]}

    @classmethod
    def from_wire(cls, body: Any) -> Manifest:
        """Parses a manifest a peer controls (a MANIFEST body, a ``latest.json``).

        Raises:
            DecodeError: naming the field.
        """
        if not isinstance(body, dict):
            raise DecodeError(f"manifest must be a map, got {type(body).__name__}")
        version, mode, lora_config = body.get("version"), body.get("mode"), body.get("lora_config")
        if type(version) is not int or mode not in MODES:
            raise DecodeError(f"manifest: bad version {version!r:.20} or mode {mode!r:.20}")
        if not isinstance(lora_config, (dict, NoneType)) or (lora_config is not None and mode != "lora"):
            raise DecodeError(f"manifest: lora_config must be a map given only with mode 'lora' (mode {mode!r})")
        incarnation = body.get("incarnation", "")
        if not isinstance(incarnation, str) or len(incarnation) > MAX_INCARNATION_CHARS:
            raise DecodeError(f"manifest: incarnation must be a string of at most {MAX_INCARNATION_CHARS} chars")
        buckets = buckets_from_wire(body.get("buckets"))
        if body.get("nbytes") != sum(b.nbytes for b in buckets):
            raise DecodeError(f"manifest: nbytes {body.get('nbytes')!r:.20} is not the sum of its buckets")
        return cls(version=version, incarnation=incarnation, mode=mode, lora_config=lora_config, buckets=buckets)


def buckets_from_wire(items: Any) -> list[Bucket]:
    """Parses and checks a manifest's buckets (peer input).

    Raises:
        DecodeError: for anything that would make a receiver read outside a bucket, mistype a tensor or drop one.
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
        if type(bucket.checksum) is not int or not 0 <= bucket.checksum < CHECKSUM_LIMIT:
            raise DecodeError(f"bucket {position}: checksum {bucket.checksum!r} is not a 64-bit checksum")
        for slot in bucket.slots:
            _check_slot(position, bucket.nbytes, slot)
            if slot.name in names:
                raise DecodeError(f"tensor {slot.name!r:.100} appears twice in the manifest")
            names.add(slot.name)
        buckets.append(bucket)
    return buckets


def _check_slot(position: int, bucket_nbytes: int, slot: TensorSlot) -> None:
    where = f"bucket {position}, tensor {slot.name!r:.100}"
    if not isinstance(slot.name, str) or slot.dtype not in TENSOR_DTYPES:
        raise DecodeError(f"{where}: bad name or dtype {slot.dtype!r:.40}")
    if not all(type(d) is int and d >= 0 for d in slot.shape) or len(slot.shape) > 16:
        raise DecodeError(f"{where}: bad shape {slot.shape!r:.100}")
    itemsize = TENSOR_DTYPES[slot.dtype].itemsize
    if type(slot.nbytes) is not int or slot.nbytes != math.prod(slot.shape) * itemsize:
        raise DecodeError(f"{where}: nbytes {slot.nbytes!r} does not match {slot.dtype}{slot.shape}")
    if type(slot.offset) is not int or slot.offset < 0 or slot.offset % itemsize:
        raise DecodeError(f"{where}: offset {slot.offset!r} is negative or misaligned for {slot.dtype}")
    if slot.offset + slot.nbytes > bucket_nbytes:
        end = slot.offset + slot.nbytes
        raise DecodeError(f"{where}: bytes [{slot.offset}, {end}) exceed the bucket's {bucket_nbytes}")


def check_checksum(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < CHECKSUM_LIMIT:
        raise DecodeError(f"{what}: checksum {value!r:.30} is not a 64-bit checksum")
    return value


# -- the bucket codec point ------------------------------------------------------------------------
def encode_bucket(data: torch.Tensor) -> dict[str, Any]:
    """The BUCKET fields that carry one bucket's bytes (``data``: uint8, the snapshot, sent zero-copy).

    Today the bytes themselves. A delta encoding returns its own fields here (and the receiver's base)."""
    return {"data": data}


def decode_bucket(bucket: Bucket, body: dict[str, Any], out: torch.Tensor) -> int:
    """Writes the bucket that a BUCKET body carries into ``out`` (uint8, ``bucket.nbytes``, the receiver's
    reused buffer) and returns the checksum of what was written (copied and hashed piece by piece).

    Raises:
        DecodeError: for a body that does not carry ``bucket.nbytes`` bytes.
    """
    data = body.get("data")
    ok = isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1
    if not ok or data.numel() != bucket.nbytes:
        got = f"{data.dtype}{list(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise DecodeError(f"bucket {bucket.index} is {got}, the manifest says {bucket.nbytes} bytes")
    return copy_checksum(out, data)
