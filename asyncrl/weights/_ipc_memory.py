"""CUDA IPC machinery of the ``cuda_ipc`` weight backend (private): handles as plain fields, device operations,
and the receive side's copy helpers.

* :class:`IpcHandle`: ``torch.multiprocessing.reductions.reduce_tensor``'s fields for a flat ``uint8`` CUDA buffer
  as a msgpack-able map (no pickle), checked on the way in, and ``rebuild_cuda_tensor``'s arguments on the way out.
* :class:`IpcMemory`: what the protocol needs from a device (allocate and export a buffer, open a peer's, interprocess
  events, side streams, markers); :class:`CudaIpcMemory` does it with CUDA. Tests without CUDA implement the same
  interface over files.
* :func:`word_sum`: the slot checksum, on the device.
* :func:`copy_into` / :class:`FlatTarget`: an engine's copy out of a staged slot, one ``_foreach_copy_`` call or one
  flat ``copy_``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from types import NoneType
from typing import Any

import torch

from asyncrl.codec import DecodeError
from asyncrl.weights.base import WeightSyncError, WeightUpdate

__all__ = ["CudaIpcMemory", "FlatTarget", "IpcHandle", "IpcMemory", "copy_into", "layout_of", "word_sum"]


# -- the handle codec ------------------------------------------------------------------------------
_BYTES_OR_NONE = (bytes, NoneType)
_HANDLE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "device_uuid": str, "device": int, "handle": bytes, "storage_size": int, "storage_offset": int,
    "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": _BYTES_OR_NONE,
    "event_sync_required": bool, "numel": int, "tensor_offset": int,
}


@dataclass(kw_only=True, slots=True, frozen=True)
class IpcHandle:
    """What ``reduce_tensor`` makes of a flat ``uint8`` CUDA tensor, as plain fields (msgpack-able).

    ``rebuild_cuda_tensor``'s classes and dtype are fixed (``torch.Tensor``, ``TypedStorage``, ``uint8``): only
    the allocation's identity, size and offsets travel.
    """

    device_uuid: str
    """The physical GPU (``get_device_properties(i).uuid``): device indices differ between processes."""
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    numel: int
    tensor_offset: int

    def to_wire(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _HANDLE_FIELDS}

    @classmethod
    def from_wire(cls, body: Any) -> IpcHandle:
        """Parses a peer's handle.

        Raises:
            DecodeError: naming the field.
        """
        if not isinstance(body, dict):
            raise DecodeError(f"IPC handle must be a map, got {type(body).__name__}")
        for key, typ in _HANDLE_FIELDS.items():
            value = body.get(key)
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise DecodeError(f"IPC handle field {key!r} must be {typ}, got {type(value).__name__}")
        h = cls(**{k: body[k] for k in _HANDLE_FIELDS})
        if min(h.device, h.storage_size, h.storage_offset, h.ref_counter_offset, h.numel, h.tensor_offset) < 0:
            raise DecodeError(f"IPC handle has a negative size or offset: {h.to_wire()!r:.300}")
        if h.tensor_offset + h.numel > h.storage_size:
            raise DecodeError(f"IPC handle: tensor [{h.tensor_offset}, {h.tensor_offset + h.numel}) exceeds its "
                              f"storage of {h.storage_size} bytes")
        return h

    @classmethod
    def from_reduce(cls, args: tuple, device_uuid: str) -> IpcHandle:
        """From ``reduce_tensor(t)[1]`` of a 1-D ``uint8`` tensor."""
        (_, size, stride, tensor_offset, _, dtype, device, handle, storage_size, storage_offset, _, ref_handle,
         ref_offset, event_handle, event_sync) = args
        if dtype != torch.uint8 or len(size) != 1 or tuple(stride) != (1,):
            raise ValueError(f"IPC handles are for flat uint8 buffers, got {dtype}{list(size)} stride {list(stride)}")
        return cls(device_uuid=device_uuid, device=int(device), handle=bytes(handle), storage_size=int(storage_size),
                   storage_offset=int(storage_offset), ref_counter_handle=bytes(ref_handle),
                   ref_counter_offset=int(ref_offset), event_handle=None if event_handle is None else bytes(event_handle),
                   event_sync_required=bool(event_sync), numel=int(size[0]), tensor_offset=int(tensor_offset))

    def rebuild_args(self, device_index: int) -> tuple:
        """``rebuild_cuda_tensor``'s arguments, on this process's index of the handle's GPU."""
        return (torch.Tensor, (self.numel,), (1,), self.tensor_offset, torch.storage.TypedStorage, torch.uint8,
                device_index, self.handle, self.storage_size, self.storage_offset, False, self.ref_counter_handle,
                self.ref_counter_offset, self.event_handle, self.event_sync_required)


# -- device operations -----------------------------------------------------------------------------
class IpcMemory:
    """The device operations the protocol needs; :class:`CudaIpcMemory` implements them with CUDA IPC."""

    device: torch.device

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A zeroed flat uint8 buffer other processes can open."""
        raise NotImplementedError

    def export(self, buf: torch.Tensor) -> dict[str, Any]:
        """``buf``'s handle, as a msgpack-able map."""
        raise NotImplementedError

    def open(self, handle: Any) -> torch.Tensor:
        """A peer's buffer from its handle (peer input: raises DecodeError or WeightSyncError)."""
        raise NotImplementedError

    def new_event(self) -> tuple[Any, bytes]:
        """An interprocess event and its handle."""
        raise NotImplementedError

    def open_event(self, handle: bytes, buf: torch.Tensor) -> Any:
        """A peer's event, recorded on the device of ``buf`` (the peer's buffer it guards)."""
        raise NotImplementedError

    def stream(self, device: torch.device | None = None) -> Any:
        """A side stream on ``device`` (default: this memory's), an object :meth:`on` accepts."""
        return None

    def on(self, stream: Any) -> Any:
        """Context manager: work enqueued inside runs on ``stream``."""
        return nullcontext()

    def after_current(self, stream: Any) -> None:
        """``stream`` waits for the calling thread's current stream."""

    def current_after(self, stream: Any) -> None:
        """The calling thread's current stream waits for ``stream``."""

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, event: Any, stream: Any) -> None: ...

    def marker(self, devices: tuple[torch.device, ...] = ()) -> Any:
        """Events recorded now on the calling thread's current streams of this memory's device and ``devices``
        (None: work enqueued so far is already done)."""
        return None

    def done(self, marker: Any) -> bool:
        return True

    def synchronize(self, stream: Any) -> None: ...


def _device_index_by_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise WeightSyncError(f"the broadcaster's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); cuda_ipc needs both ends on one node")


class CudaIpcMemory(IpcMemory):
    """CUDA IPC on one GPU of this process (``device``: an index or ``cuda:i``; default: the current one)."""

    def __init__(self, device: int | str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise WeightSyncError("weights.type 'cuda_ipc' needs CUDA; use 'shm' (same machine) or 'zmq' without GPUs")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"cuda_ipc device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._uuid = str(torch.cuda.get_device_properties(self.device).uuid)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def export(self, buf: torch.Tensor) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        return IpcHandle.from_reduce(reduce_tensor(buf)[1], self._uuid).to_wire()

    def open(self, handle: Any) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        h = IpcHandle.from_wire(handle)
        index = _device_index_by_uuid(h.device_uuid)
        try:
            with torch.cuda.device(index):
                return rebuild_cuda_tensor(*h.rebuild_args(index))
        except RuntimeError as e:  # a CUDA error: a stale or foreign handle, or IPC unsupported here
            raise WeightSyncError(f"cannot open the broadcaster's CUDA IPC buffer on cuda:{index}: {e}") from e

    def new_event(self) -> tuple[Any, bytes]:
        with torch.cuda.device(self.device):
            ev = torch.cuda.Event(interprocess=True)
            ev.record()  # an event must be recorded once before its handle is taken
            return ev, bytes(ev.ipc_handle())

    def open_event(self, handle: bytes, buf: torch.Tensor) -> Any:
        try:
            return torch.cuda.Event.from_ipc_handle(buf.device, handle)
        except RuntimeError as e:
            raise WeightSyncError(f"cannot open the broadcaster's CUDA IPC event on {buf.device}: {e}") from e

    def stream(self, device: torch.device | None = None) -> Any:
        return torch.cuda.Stream(self.device if device is None else device)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def after_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def current_after(self, stream: Any) -> None:
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, event: Any, stream: Any) -> None:
        stream.wait_event(event)

    def marker(self, devices: tuple[torch.device, ...] = ()) -> Any:
        events = []
        for d in dict.fromkeys((self.device, *devices)):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events.append(ev)
        return events

    def done(self, marker: Any) -> bool:
        return marker is None or all(ev.query() for ev in marker)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()


def word_sum(data: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of a flat uint8 buffer's 64-bit words (length a multiple of 8), as a 0-d int64 tensor on
    its device: order-independent, so either end may compute it in any reduction order."""
    return data.view(torch.int64).sum(dtype=torch.int64)



def copy_into(update: WeightUpdate, targets: Mapping[str, torch.Tensor]) -> None:
    """Copies a staged update into an engine's tensors in one ``torch._foreach_copy_`` call (no Python loop per
    tensor on the GPU's critical path). For one copy of the whole slot, see :class:`FlatTarget`.

    Raises:
        KeyError: for a tensor the engine does not have.
    """
    names = list(update.tensors)
    torch._foreach_copy_([targets[n] for n in names], [update.tensors[n] for n in names], non_blocking=True)


Layout = tuple[tuple[str, int, torch.dtype, tuple[int, ...]], ...]


def layout_of(tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> Layout:
    """``(name, byte offset in flat or -1 if empty, dtype, shape)`` of views into ``flat``."""
    base = flat.data_ptr()
    return tuple((n, t.data_ptr() - base if t.numel() else -1, t.dtype, tuple(t.shape)) for n, t in tensors.items())


def _layout(update: WeightUpdate) -> Layout | None:
    """The update's layout in its slot: the receiver's (one object per layout), else computed."""
    layout = update.metadata.get("layout")
    if layout is not None:
        return layout
    flat = update.metadata.get("flat")
    return None if flat is None else layout_of(update.tensors, flat)


class FlatTarget:
    """An engine's tensors re-homed as views into one flat buffer laid out like a staged update's slot, so that
    applying a later update of the same layout is one device copy (``flat.copy_(slot)``).

    Args:
        update: a staged :class:`CudaIpcWeightReceiver` update (its ``metadata["flat"]`` and views give the layout).
        params: the engine's tensors by the update's names (``dict(model.named_parameters())``); each
            ``nn.Parameter``'s ``.data`` becomes its view (current values kept).
    """

    def __init__(self, update: WeightUpdate, params: Mapping[str, torch.Tensor]):
        self.layout = _layout(update)
        if self.layout is None:
            raise ValueError("FlatTarget needs an update staged in a slot (metadata['flat'])")
        device = next(iter(params.values())).device if params else update.metadata["flat"].device
        self.flat = torch.zeros(update.metadata["flat"].numel(), dtype=torch.uint8, device=device)
        for name, offset, dtype, shape in self.layout:
            p = params[name]
            if p.dtype != dtype or tuple(p.shape) != shape:
                raise ValueError(f"engine tensor {name!r} is {p.dtype}{list(p.shape)}, the update's is "
                                 f"{dtype}{list(shape)}")
            if offset < 0:
                continue
            view = self.flat[offset : offset + p.numel() * p.element_size()].view(dtype).view(shape)
            view.copy_(p.detach())
            p.data = view

    def apply(self, update: WeightUpdate) -> bool:
        """One copy if ``update`` has this layout (True); False otherwise (use :func:`copy_into`)."""
        layout = _layout(update)
        if layout is not self.layout and layout != self.layout:
            return False
        self.flat.copy_(update.metadata["flat"], non_blocking=True)
        return True
