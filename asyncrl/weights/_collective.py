"""Private machinery of the collective weight backend (:mod:`asyncrl.weights.nccl`).

* :class:`RendezvousStore`: a ``torch.distributed.Store`` whose keys live in the broadcaster's process
  and travel over the weight channel's own ZeroMQ socket (loopback, or CURVE beyond it). A
  ``TCPStore`` would do the same job but listens on every interface (``*:port``, seen with torch
  2.13 even when created with ``127.0.0.1``) with no authentication; this store opens no socket at
  all, so the group's rendezvous is exactly as guarded as the control channel.
* :func:`new_group`: a process group of the weight channel's own, constructed directly
  (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over that store), never the default group: the
  trainer's ``torch.distributed`` state is untouched and receivers started by other launchers can
  join.
* :func:`broadcast` / :func:`send` / :func:`recv`: one bucket, blocking until it has moved (a CUDA
  bucket: until the stream has finished with it).
* :func:`checksum`: :func:`asyncrl.weights.base.bucket_checksum` of a CPU bucket; a CUDA
  bucket gets a position-weighted wrapping sum computed on the device (no library computes crc32c on
  a GPU; copying the bucket back to the host to hash it would cost more than the transfer).

Who blocks: every call here blocks its caller's thread (the receiver's data thread or the
broadcaster's I/O thread). A store ``get`` blocks until the key is set or ``timeout_s``.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from asyncrl.weights.base import Bucket, WeightSyncError, bucket_checksum

__all__ = ["KeyTable", "RendezvousStore", "broadcast", "checksum", "fill_device_bucket", "new_group", "recv", "send"]

_ROW = 1 << 16
"""CUDA fingerprint: int64 words per row; each row's wrapping sum is weighted by an odd row factor."""


class KeyTable:
    """The rendezvous keys of every generation, kept by the broadcaster (thread-safe)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._keys: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._keys[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key: str) -> bytes | None:
        with self._cv:
            return self._keys.get(key)

    def wait_get(self, key: str, timeout: float) -> bytes | None:
        with self._cv:
            self._cv.wait_for(lambda: key in self._keys, timeout)
            return self._keys.get(key)

    def drop_prefix(self, prefix: str) -> None:
        with self._cv:
            for key in [k for k in self._keys if k.startswith(prefix)]:
                del self._keys[key]


class RendezvousStore(dist.Store):
    """A ``Store`` for one group formation: ``set`` and ``get`` go through ``request``.

    Args:
        prefix: the generation's secret key prefix (a rogue that reaches the channel cannot guess it).
        request: ``request(op, key, value) -> bytes | None``; ``op`` is ``"set"`` or ``"get"`` (``None``:
            the key is not set yet). The broadcaster passes its :class:`KeyTable`, a receiver a round
            trip over its DEALER.
        timeout_s: how long ``get``/``wait`` wait for a key before the formation fails.
    """

    def __init__(self, prefix: str, request: Callable[[str, str, bytes], bytes | None], timeout_s: float):
        super().__init__()
        self.prefix = prefix
        self._request = request
        self._timeout_s = timeout_s

    def set(self, key: str, value: bytes | str) -> None:
        self._request("set", self.prefix + key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        delay = 0.002
        while (value := self._request("get", self.prefix + key, b"")) is None:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"rendezvous key {key!r} not set within {self._timeout_s} s "
                                      f"(a member of the group did not join; form_timeout_s)")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._request("get", self.prefix + k, b"") is not None for k in keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, *, host: str, timeout_s: float):
    """A process group of the weight channel's own (blocks until every member has joined).

    Args:
        backend: ``gloo`` (CPU buckets) or ``nccl`` (CUDA buckets).
        host: the address gloo's sockets bind to (``127.0.0.1`` on one machine).
        timeout_s: the group's per-operation timeout (a member that hangs fails the operation).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return pg
    raise ValueError(f"{backend=} must be 'gloo' or 'nccl'")


def _finish(work, buf: torch.Tensor) -> None:
    work.wait()
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


def broadcast(pg, buf: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    _finish(pg.broadcast([buf], opts), buf)


def send(pg, buf: torch.Tensor, dst: int) -> None:
    _finish(pg.send([buf], dst, 0), buf)


def recv(pg, buf: torch.Tensor, src: int) -> None:
    _finish(pg.recv([buf], src, 0), buf)


def fill_device_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copies the bucket's tensors into ``out`` (uint8 on a GPU) at their offsets, padding zeroed."""
    out.zero_()
    for slot in bucket.slots:
        if slot.nbytes:
            src = tensors[slot.name].detach()
            out[slot.offset : slot.offset + slot.nbytes].view(src.dtype).view(src.shape).copy_(src, non_blocking=True)


def checksum(buf: torch.Tensor) -> int:
    """Bucket checksum, the same on both ends: ``bucket_checksum`` on the CPU, a device fingerprint on CUDA (64 bits)."""
    if not buf.is_cuda:
        return bucket_checksum(memoryview(buf.numpy()))
    n = buf.numel()
    if n % 8:
        raise ValueError(f"CUDA bucket of {n} bytes is not a whole number of int64 words")
    words = buf.view(torch.int64)
    full = words.numel() // _ROW * _ROW
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    if full:
        rows = words[:full].view(-1, _ROW).sum(dim=1)
        weights = torch.arange(1, 2 * rows.numel(), 2, dtype=torch.int64, device=buf.device) * 0x9E3779B1
        total += (rows * weights).sum()
    if full < words.numel():
        total += words[full:].sum() * 0x85EBCA77
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF
