"""Batch dumps: a message of the wire codec written to one file, for diagnosis and replay.

A dump is the codec's frames (msgpack header + raw tensor frames) packed as one msgpack array, so
it carries tensors of any dtype without pickle and loads with the same validation as the wire.
Written atomically (temp file, then ``os.replace``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.codec import DecodeError, decode, encode

__all__ = ["read_dump", "write_dump"]

MAX_DUMP_BYTES = 1 << 32


def write_dump(path: str | os.PathLike, kind: str, body: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [bytes(f) for f in encode(kind, body)]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(msgpack.packb(frames, use_bin_type=True))
    os.replace(tmp, path)
    return path


def read_dump(path: str | os.PathLike) -> tuple[str, Any]:
    """``(kind, body)`` of a dump; tensors are read-only views of the file's bytes.

    Raises:
        DecodeError: if the file is not a well-formed dump.
    """
    try:
        frames = msgpack.unpackb(Path(path).read_bytes(), raw=False)
    except Exception as e:  # any msgpack failure: not a dump
        raise DecodeError(f"{path}: not an asyncrl dump ({e})") from e
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise DecodeError(f"{path}: not an asyncrl dump (expected a list of frames)")
    return decode(frames, max_message_bytes=MAX_DUMP_BYTES)
