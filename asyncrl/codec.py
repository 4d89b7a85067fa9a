"""Wire codec: msgpack headers with tensors as separate zero-copy frames.

A message is a list of frames::

    frame 0      msgpack  [MAGIC, SCHEMA_VERSION, kind, body]
    frame 1..n   raw tensor bytes, referenced from the header by index

Tensors (``torch.Tensor`` and ``numpy.ndarray``) anywhere in ``body`` become msgpack ext values
holding ``(dtype, shape, frame_index)``; tensors under ``INLINE_MAX_BYTES`` carry their bytes inline
instead, because a separate ZeroMQ frame costs more than copying a few bytes. Decoding builds
tensors with ``torch.frombuffer`` over the received frames (no copy) and validates everything a
peer controls: magic, schema version, kind, sizes, dtypes, shapes, frame indices and the use of
every frame exactly once. Any violation raises :class:`DecodeError`, the one exception type for
bad input. There is no pickle anywhere: unknown Python types raise on encode.

Modelled on vLLM's ``v1/serial_utils.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import orjson
import torch

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DecodeError",
    "Frame",
    "INLINE_MAX_BYTES",
    "MAGIC",
    "SCHEMA_VERSION",
    "TENSOR_DTYPES",
    "decode",
    "dumps_json",
    "encode",
    "loads_json",
]

MAGIC = "arl"
SCHEMA_VERSION = 1
INLINE_MAX_BYTES = 512
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_FRAMES = 4096
MAX_NDIM = 8

_EXT_TENSOR = 1  # torch.Tensor, bytes in a separate frame
_EXT_TENSOR_INLINE = 2  # torch.Tensor, bytes inline
_EXT_NDARRAY = 3  # numpy.ndarray, bytes in a separate frame
_EXT_NDARRAY_INLINE = 4  # numpy.ndarray, bytes inline

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""The tensor dtypes that travel, by wire name (rollouts and weights share this table)."""
_TORCH_DTYPES = TENSOR_DTYPES
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
_NUMPY_DTYPES = {k: np.dtype(k) for k in _TORCH_DTYPES if k != "bfloat16"}

# Decoded tensors alias the received (read-only) frame; torch warns once about that. We never write
# into decoded tensors in place: consumers copy when they pad/collate.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

Frame = bytes | bytearray | memoryview


class DecodeError(ValueError):
    """A message from a peer is malformed, oversized or violates the schema.

    Raised by :func:`decode` and by every schema check built on it (rollouts, protocol messages).
    Receivers count it and drop the message; nothing already accepted is affected.
    """


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.device.type == "cpu" and t.dtype != torch.bfloat16 and t.numel() and t.is_contiguous() and not t.requires_grad:
        return memoryview(t.numpy()).cast("B")  # the common case, ~4x cheaper than the general path
    # reshape(-1) handles 0-d tensors; contiguous() copies non-contiguous views once.
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode(kind: str, body: Any) -> list[Frame]:
    """Encodes one message into frames.

    Args:
        kind: the message type, checked by the receiver against its known kinds.
        body: msgpack-able data (dict, list, str, int, float, bool, None, bytes) with tensors or
            numpy arrays anywhere inside.

    Returns:
        ``[header, *tensor_frames]``; tensor frames are zero-copy views of the tensors' memory, so
        keep the tensors alive and unmodified until the frames are sent.

    Raises:
        TypeError: for a value msgpack cannot carry (never pickled).
    """
    frames: list[Frame] = [b""]

    def default(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, torch.Tensor):
            name = _DTYPE_NAMES.get(obj.dtype)
            if name is None:
                raise TypeError(f"tensor dtype {obj.dtype} is not supported on the wire")
            data = _tensor_bytes(obj)
            shape = list(obj.shape)
            code_inline, code_frame = _EXT_TENSOR_INLINE, _EXT_TENSOR
        elif isinstance(obj, np.ndarray):
            name = obj.dtype.name
            if name not in _NUMPY_DTYPES:
                raise TypeError(f"array dtype {obj.dtype} is not supported on the wire")
            # the wire carries native byte order (as for torch tensors): byte-swap arrays like ">i4" first
            data = memoryview(np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("=")).reshape(-1).view(np.uint8))
            shape = list(obj.shape)
            code_inline, code_frame = _EXT_NDARRAY_INLINE, _EXT_NDARRAY
        elif isinstance(obj, (np.integer, np.floating, np.bool_)):
            return obj.item()
        elif isinstance(obj, tuple):
            return list(obj)
        else:
            raise TypeError(f"cannot encode {type(obj).__name__} (no pickle on the wire)")
        if data.nbytes <= INLINE_MAX_BYTES:
            return msgpack.ExtType(code_inline, msgpack.packb([name, shape, data.tobytes()]))
        frames.append(data)
        return msgpack.ExtType(code_frame, msgpack.packb([name, shape, len(frames) - 1]))

    frames[0] = msgpack.packb([MAGIC, SCHEMA_VERSION, kind, body], default=default, use_bin_type=True)
    return frames


def _frame_view(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes/bytearray/memoryview are used directly.
    buf = getattr(frame, "buffer", frame)
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise DecodeError(f"frame of type {type(frame).__name__} is not a byte buffer") from e


class _Decoder:
    def __init__(self, frames: list[memoryview]):
        self.frames = frames
        self.used = [False] * len(frames)

    def _parse(self, data: bytes, want_frame: bool) -> tuple[str, list[int], Any]:
        try:
            name, shape, ref = msgpack.unpackb(data, raw=False)
        except Exception as e:  # any msgpack failure on peer bytes is bad input
            raise DecodeError(f"malformed tensor header: {e}") from e
        if not isinstance(name, str) or name not in _TORCH_DTYPES:
            raise DecodeError(f"unknown tensor dtype {name!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise DecodeError(f"tensor shape must be a list of at most {MAX_NDIM} dims, got {shape!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
            raise DecodeError(f"tensor shape has a negative or non-integer dim: {shape!r}")
        if want_frame and (not isinstance(ref, int) or isinstance(ref, bool)):
            raise DecodeError(f"tensor frame index must be an int, got {type(ref).__name__}")
        if not want_frame and not isinstance(ref, bytes):
            raise DecodeError("inline tensor data must be bytes")
        return name, shape, ref

    def _buffer(self, ref: Any, want_frame: bool) -> memoryview:
        if not want_frame:
            return memoryview(ref)
        if not 1 <= ref < len(self.frames):
            raise DecodeError(f"tensor frame index {ref} out of range (message has {len(self.frames)} frames)")
        if self.used[ref]:
            raise DecodeError(f"tensor frame {ref} referenced twice")
        self.used[ref] = True
        return self.frames[ref]

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code not in (_EXT_TENSOR, _EXT_TENSOR_INLINE, _EXT_NDARRAY, _EXT_NDARRAY_INLINE):
            raise DecodeError(f"unknown ext type {code}")
        want_frame = code in (_EXT_TENSOR, _EXT_NDARRAY)
        name, shape, ref = self._parse(data, want_frame)
        buf = self._buffer(ref, want_frame)
        dtype = _TORCH_DTYPES[name]
        numel = math.prod(shape)
        expected = numel * dtype.itemsize
        if buf.nbytes != expected:
            raise DecodeError(f"tensor {name}{shape} needs {expected} bytes, frame has {buf.nbytes}")
        if code in (_EXT_NDARRAY, _EXT_NDARRAY_INLINE):
            if name not in _NUMPY_DTYPES:
                raise DecodeError(f"numpy has no dtype {name!r}")
            return np.frombuffer(buf, dtype=_NUMPY_DTYPES[name]).reshape(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(shape)


def decode(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[str, Any]:
    """Decodes and validates the framing of one message.

    Args:
        frames: the frames as received (``bytes``, ``memoryview`` or ``zmq.Frame``).
        max_message_bytes: the largest total size accepted.

    Returns:
        ``(kind, body)``; tensors in ``body`` alias the frames (read-only, zero-copy).

    Raises:
        DecodeError: on anything malformed; the message's kind is not checked here (callers know
            which kinds they accept).
    """
    if not frames:
        raise DecodeError("empty message")
    if len(frames) > MAX_FRAMES:
        raise DecodeError(f"message has {len(frames)} frames, more than {MAX_FRAMES}")
    views = [_frame_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise DecodeError(f"message of {total} bytes exceeds max_message_bytes={max_message_bytes}")
    decoder = _Decoder(views)
    try:
        # unpackb bounds string/bin/array/map lengths by the buffer's own size.
        header = msgpack.unpackb(views[0], raw=False, ext_hook=decoder.ext_hook, strict_map_key=True)
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, RecursionError, ...)
        raise DecodeError(f"malformed header: {type(e).__name__}: {e}") from e
    # type checks before comparing: a peer may put a tensor/array here, whose == is elementwise
    if not isinstance(header, list) or len(header) != 4 or not isinstance(header[0], str) or header[0] != MAGIC:
        raise DecodeError("not an asyncrl message (bad magic or header shape)")
    _, version, kind, body = header
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DecodeError(f"schema version {version!r} does not match this side's {SCHEMA_VERSION}; upgrade both ends")
    if not isinstance(kind, str):
        raise DecodeError(f"message kind must be a string, got {type(kind).__name__}")
    unused = [i for i, u in enumerate(decoder.used) if i and not u]
    if unused:
        raise DecodeError(f"frames {unused} are not referenced by the header")
    return kind, body


def dumps_json(obj: Any) -> bytes:
    """JSON for metrics and logs (orjson; numpy scalars and arrays allowed)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


def loads_json(data: bytes | str) -> Any:
    return orjson.loads(data)
