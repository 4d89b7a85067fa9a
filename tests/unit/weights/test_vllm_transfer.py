"""asyncrl's vLLM weight-transfer engine without an engine start: how an update is offered and how vLLM's worker
resolves it — by reference in this process, or through the shm segment's file from another process (the pid is
made foreign here) — and the refusals: a slot reused for a later publish, offsets outside the segment, an update
that is in no segment, an offer already withdrawn."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weights.shm import ShmWeightBroadcaster, ShmWeightReceiver

pytestmark = pytest.mark.vllm

_vllm_transfer = pytest.importorskip("workers.engines._vllm_transfer")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 4, generator=g), "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3)}


class _Engine(_vllm_transfer.AsyncrlWeightTransferEngine):
    """The engine's resolution half, without a model (vLLM constructs the real one in its worker)."""

    def __init__(self):
        self._maps = {}


def _info(**kw):
    return _vllm_transfer.AsyncrlUpdateInfo(**kw)


@pytest.fixture
def staged(tmp_path):
    b = ShmWeightBroadcaster(tmp_path / "w", bucket_bytes=64)
    r = ShmWeightReceiver(b.address, receiver_id="r0", poll_s=0.001)
    r.start()
    yield b, r
    r.close()
    b.close()


def test_offer_by_reference_and_through_the_segment_file(staged):
    b, r = staged
    b.publish(_tensors(1), version=1)
    update = r.wait(1, timeout=10)
    info = _vllm_transfer.offer(update)
    assert info["segment"]["path"] == update.metadata["segment_path"]
    engine = _Engine()
    local = dict(engine._resolve(_info(**info)))
    assert all(local[n] is t for n, t in update.tensors.items())  # the staged views themselves, no copy
    foreign = dict(engine._resolve(_info(**{**info, "pid": -1})))  # as vLLM's worker in another process sees it
    assert foreign.keys() == update.tensors.keys()
    for name, t in _tensors(1).items():
        assert foreign[name].dtype == t.dtype and torch.equal(foreign[name], t), name
    _vllm_transfer.withdraw(info)
    with pytest.raises(ValueError, match="no offered update"):
        engine._resolve(_info(**info))


def test_a_reused_slot_or_a_lying_offset_is_refused(staged):
    b, r = staged
    b.publish(_tensors(1), version=1)
    u1 = r.wait(1, timeout=10)
    info = _vllm_transfer.offer(u1)
    _vllm_transfer.withdraw(info)
    seg = info["segment"]
    engine = _Engine()
    bad = {**seg, "tensors": [[n, d, s, o + 10**9 if o >= 0 else o] for n, d, s, o in seg["tensors"]]}
    with pytest.raises(ValueError, match="outside segment"):
        engine._resolve(_info(version=1, pid=-1, segment=bad))
    with pytest.raises(ValueError, match="not the offered publish"):
        engine._resolve(_info(version=1, pid=-1, segment={**seg, "publish": seg["publish"] + 7}))
    with pytest.raises(ValueError, match="not staged in a shm segment"):
        engine._resolve(_info(version=1, pid=-1))
    with pytest.raises(ValueError, match="cannot map segment"):
        engine._resolve(_info(version=1, pid=-1, segment={**seg, "path": seg["path"] + ".gone"}))


def test_an_update_not_in_one_segment_has_no_segment_info():
    from asyncrl.weights.base import WeightUpdate

    heap = WeightUpdate(version=3, mode="full", tensors=_tensors(2), metadata={"segment_path": "/nowhere", "publish": 1})
    info = _vllm_transfer.offer(heap)  # separate heap tensors: only by reference
    _vllm_transfer.withdraw(info)
    assert info["segment"] is None and info["version"] == 3
