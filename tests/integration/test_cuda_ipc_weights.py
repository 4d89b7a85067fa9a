"""The cuda_ipc weight backend without CUDA: the handle codec and its refusals, the bind rule, and the whole slot
protocol (two persistent slots opened once, verify-then-stage views, release after the engine's reads, double
buffering, a stuck reader, a corrupted slot, a lying broadcaster) over :class:`FileIpcMemory`, a stand-in with
:class:`~asyncrl.weights._ipc_memory.IpcMemory`'s interface whose "device memory" is a file mapped by both ends.
The CUDA path itself runs in ``tests/integration/test_cuda_ipc_gpu.py`` (skipped without CUDA)."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from asyncrl.codec import DecodeError, encode
from asyncrl.weights import setup_weight_broadcaster
from asyncrl.weights._ipc_memory import FlatTarget, IpcHandle, IpcMemory, copy_into
from asyncrl.weights.base import WeightSyncError
from asyncrl.weights.cuda_ipc import (
    VERSION,
    CudaIpcWeightBroadcaster,
    CudaIpcWeightReceiver,
    check_ipc_bind,
)

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


class FileIpcMemory(IpcMemory):
    """Shared 'device' buffers as files in one directory, each end mapping them itself; no streams or events
    (every operation is synchronous), so ordering is the protocol's alone."""

    def __init__(self, directory: Path):
        self.device = torch.device("cpu")
        self.directory = directory
        self._n = 0
        self._maps: list[mmap.mmap] = []
        self._paths: dict[int, str] = {}

    def alloc(self, nbytes: int) -> torch.Tensor:
        self._n += 1
        path = self.directory / f"buf-{os.getpid()}-{id(self)}-{self._n}"
        with open(path, "wb") as f:
            f.truncate(nbytes)
        buf = self._map(path)
        self._paths[buf.data_ptr()] = str(path)
        return buf

    def _map(self, path: Path) -> torch.Tensor:
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def export(self, buf: torch.Tensor) -> dict[str, Any]:
        return {"path": self._paths[buf.data_ptr()]}

    def open(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, dict) or not isinstance(handle.get("path"), str):
            raise DecodeError(f"bad file handle {handle!r:.100}")
        try:
            return self._map(Path(handle["path"]))
        except OSError as e:
            raise WeightSyncError(f"cannot open {handle['path']}: {e}") from e

    def new_event(self) -> tuple[Any, bytes]:
        return None, b"-"

    def open_event(self, handle: bytes, buf: torch.Tensor) -> Any:
        return None


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "layer.0.bias": torch.randn(5, generator=g),
            "layer.0.weight": torch.randn(6, 3, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 4)}


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(start: bool = True, slot_wait_s: float = 0.5, receiver_id: str = "r0"):
        b = CudaIpcWeightBroadcaster(memory=FileIpcMemory(tmp_path), slot_wait_s=slot_wait_s)
        r = CudaIpcWeightReceiver(b.address, receiver_id=receiver_id, memory=FileIpcMemory(tmp_path), timeout_s=10)
        made.extend([r, b])
        if start:
            r.start()
        return b, r

    yield make
    for x in made:
        x.close()


def _until(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


# -- the handle codec ------------------------------------------------------------------------------
def _handle(**over) -> dict[str, Any]:
    h = {"device_uuid": "GPU-1", "device": 0, "handle": b"\x01" * 64, "storage_size": 4096, "storage_offset": 0,
         "ref_counter_handle": b"/torch_1", "ref_counter_offset": 0, "event_handle": None,
         "event_sync_required": False, "numel": 4096, "tensor_offset": 0}
    h.update(over)
    return h


def test_ipc_handles_round_trip_as_plain_fields():
    h = IpcHandle.from_wire(_handle(event_handle=b"\x02" * 64, event_sync_required=True))
    assert IpcHandle.from_wire(h.to_wire()) == h
    args = h.rebuild_args(device_index=3)
    assert args[0] is torch.Tensor and args[5] is torch.uint8 and args[6] == 3 and args[1] == (4096,)
    reduced = (torch.Tensor, torch.Size([4096]), (1,), 0, object, torch.uint8, 0, b"\x01" * 64, 4096, 0, False,
               b"/torch_1", 0, None, False)
    assert IpcHandle.from_reduce(reduced, "GPU-1") == IpcHandle.from_wire(_handle())


@pytest.mark.parametrize("over, match", [
    ({"handle": "text"}, "'handle'"),
    ({"numel": True}, "'numel'"),
    ({"storage_offset": -1}, "negative"),
    ({"numel": 8192}, "exceeds its storage"),
    ({"device_uuid": None}, "'device_uuid'"),
])
def test_a_malformed_handle_is_refused_by_field(over, match):
    with pytest.raises(DecodeError, match=match):
        IpcHandle.from_wire(_handle(**over))
    with pytest.raises(DecodeError, match="must be a map"):
        IpcHandle.from_wire([1, 2])


def test_only_flat_uint8_buffers_are_exported():
    reduced = (torch.Tensor, torch.Size([4, 4]), (4, 1), 0, object, torch.float32, 0, b"", 64, 0, False, b"", 0,
               None, False)
    with pytest.raises(ValueError, match="flat uint8"):
        IpcHandle.from_reduce(reduced, "GPU-1")


def test_binds_off_the_node_are_refused():
    check_ipc_bind("ipc:///tmp/x.sock")
    check_ipc_bind("tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="this node only"):
        check_ipc_bind("tcp://0.0.0.0:5555")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_backend_says_what_to_use_instead():
    with pytest.raises(WeightSyncError, match="needs CUDA; use 'shm'"):
        setup_weight_broadcaster("cuda_ipc")


# -- the protocol over file memory -----------------------------------------------------------------
def test_versions_reach_the_receiver_through_two_persistent_slots(pair):
    b, r = pair()
    for v in (1, 2, 3, 4):
        sent = _tensors(v)
        b.publish(sent, version=v)
        u = r.wait(v, timeout=10)
        assert u is not None and u.version == v
        for name, t in sent.items():
            assert u.tensors[name].dtype == t.dtype and torch.equal(u.tensors[name], t), name
        r.commit(v)
    _until(lambda: b.committed() == {"r0": 4})
    s = b.stats()
    assert s["slots_allocated"] == 2 and s.get("slots_replaced", 0) == 0
    assert r.stats()["slots_opened"] == 2 and r.stats()["failures"] == 0
    _until(lambda: not any(b.stats()["holders"].values()))  # every slot released after its commit


def test_slots_are_opened_at_start_up_when_the_layout_is_prepared(pair):
    b, r = pair(start=False)
    b.prepare(_tensors(0))
    r.start()
    _until(lambda: r.stats()["slots_opened"] == 2)
    assert r.poll() is None
    b.publish(_tensors(1), version=1)
    assert r.wait(1, timeout=10) is not None and r.stats()["slots_opened"] == 2


def test_a_receiver_that_cannot_open_the_slots_fails_start_with_the_reason(pair, tmp_path):
    b, r = pair(start=False)
    b.prepare(_tensors(0))
    for f in tmp_path.glob("buf-*"):
        f.unlink()  # as if the handles were stale (or from a GPU this process does not see)
    with pytest.raises(WeightSyncError, match="cannot start: cannot open"):
        r.start()


def test_a_reader_of_v_is_never_overwritten_by_later_versions(pair):
    b, r = pair(slot_wait_s=0.2)
    b.publish(_tensors(1), version=1)
    held = r.wait(1, timeout=10)  # handed out, not committed: the engine may still be reading it
    snapshot = {n: t.clone() for n, t in held.tensors.items()}
    b.publish(_tensors(2), version=2)  # the other slot
    t0 = time.monotonic()
    b.publish(_tensors(3), version=3)  # would reuse version 1's slot: waits, then takes a fresh one
    assert time.monotonic() - t0 >= 0.15
    assert b.stats()["slots_replaced"] == 1
    for name, t in snapshot.items():
        assert torch.equal(held.tensors[name], t), f"{name} of the held version changed"
    u = r.wait(3, timeout=10)
    assert torch.equal(u.tensors["embed.weight"], _tensors(3)["embed.weight"])
    assert r.stats()["slots_opened"] == 3  # the fresh slot, opened on sight


def test_a_corrupted_slot_is_refused_and_the_committed_version_stays(pair):
    b, r = pair(start=False)
    b.publish(_tensors(1), version=1)
    slot = b._slots[0]
    slot.buf[200] ^= 0xFF  # after the checksum went into the header
    r.start()
    _until(lambda: r.stats()["failures"] >= 1)
    assert r.poll() is None and r.stats()["checksum_mismatches"] >= 1
    assert "checksum mismatch in slot" in r.stats()["recent_failures"][0]["reason"]
    _until(lambda: not any(b.stats()["holders"].values()))  # refused versions are released too
    b.publish(_tensors(2), version=2)
    assert r.wait(2, timeout=10) is not None


def test_a_lying_broadcaster_is_counted_and_stages_nothing(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    r = CudaIpcWeightReceiver(f"tcp://127.0.0.1:{port}", receiver_id="r0", memory=FileIpcMemory(tmp_path),
                              timeout_s=10)
    try:
        import threading

        starter = threading.Thread(target=r.start)
        starter.start()
        assert router.poll(10_000)
        identity = router.recv_multipart()[0]
        router.send_multipart([identity, *encode(VERSION, {"version": None, "slots": []})])
        starter.join(10)
        manifest = {"version": 1, "incarnation": "", "mode": "full", "lora_config": None, "nbytes": 64,
                    "buckets": [{"index": 0, "nbytes": 64, "checksum": 0, "slots": [["w", "float32", [16], 0, 64]]}]}
        bad = [
            {"version": None, "slots": [{"id": 1, "handle": {"path": str(tmp_path / "missing")}, "event": b"-",
                                         "nbytes": 128}]},
            {**manifest, "slots": [], "slot": 9, "publish": 1},  # a slot it never sent
            {**manifest, "slots": [{"id": "x"}], "slot": 1, "publish": 1},
        ]
        for body in bad:
            router.send_multipart([identity, *encode(VERSION, body)])
        _until(lambda: r.stats()["failures"] >= 3)
        assert r.poll() is None and r.stats()["bad_messages"] >= 2
        reasons = " | ".join(f["reason"] for f in r.stats()["recent_failures"])
        assert "cannot open" in reasons and "never sent" in reasons
    finally:
        r.close()
        router.close(linger=0)
        ctx.term()


def test_engine_copies_one_foreach_call_or_one_flat_copy(pair):
    b, r = pair()
    b.publish(_tensors(1), version=1)
    u1 = r.wait(1, timeout=10)
    params = {n: torch.nn.Parameter(torch.zeros_like(t), requires_grad=False) for n, t in u1.tensors.items()}
    copy_into(u1, params)
    assert all(torch.equal(params[n], t) for n, t in u1.tensors.items())
    target = FlatTarget(u1, params)  # the engine's tensors now live in one flat buffer, values kept
    assert all(torch.equal(params[n], t) for n, t in u1.tensors.items())
    r.commit(1)
    b.publish(_tensors(2), version=2)
    u2 = r.wait(2, timeout=10)
    assert target.apply(u2)
    assert all(torch.equal(params[n], t) for n, t in _tensors(2).items())
    with pytest.raises(ValueError, match="engine tensor 'embed.weight'"):
        FlatTarget(u2, {**params, "embed.weight": torch.zeros(3)})
