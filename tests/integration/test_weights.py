"""Weight sync backends in one process: round trips, newest-wins, LoRA, faults, commits (zmq and shm)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import orjson
import pytest
import torch
import zmq

from asyncrl.codec import encode
from asyncrl.weights import (
    WeightBroadcaster,
    WeightReceiver,
    WeightSyncError,
    plan_buckets,
    setup_weight_broadcaster,
    setup_weight_receiver,
)
from tests.weights_utils import corrupt_next

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

WAIT_S = 10.0


@pytest.fixture(params=["zmq", "shm"])
def backend(request) -> Iterator[tuple[Callable[..., WeightBroadcaster], Callable[..., WeightReceiver]]]:
    opened: list = []

    def broadcaster(**kw) -> WeightBroadcaster:
        b = setup_weight_broadcaster(request.param, **kw)
        opened.append(b)
        return b

    def receiver(b: WeightBroadcaster, receiver_id: str = "r0") -> WeightReceiver:
        r = setup_weight_receiver(request.param, b.address, receiver_id=receiver_id)
        opened.append(r)
        r.start()
        return r

    yield broadcaster, receiver
    for obj in reversed(opened):
        obj.close()


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(33, 16, generator=g),
        "layers.0.attn.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.mlp.up.weight": torch.randn(24, 16, generator=g).t(),  # non-contiguous
        "position_ids": torch.arange(37),
        "norm.weight": torch.ones(16, dtype=torch.float16),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def eventually(check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_round_trip(backend):
    make_b, make_r = backend
    b = make_b()
    sd = state_dict()
    want = {k: v.clone() for k, v in sd.items()}
    stats = b.publish(sd, 1)
    sd["embed.weight"].add_(1)  # publish snapshots: later training steps do not leak into version 1
    r = make_r(b)
    update = r.wait(1, WAIT_S)
    assert update is not None and update.version == 1 and update.mode == "full" and update.lora_config is None
    assert_same(update.tensors, want)
    assert update.nbytes == sum(t.nbytes for t in want.values()) and stats["bytes"] >= update.nbytes
    assert r.poll() is update  # staged until committed


def test_late_joiner_gets_only_the_newest(backend):
    make_b, make_r = backend
    b = make_b()
    for v in (1, 2, 3):
        b.publish({"w": torch.full((8,), float(v))}, v)
    r = make_r(b)
    update = r.wait(1, WAIT_S)
    assert update is not None and update.version == 3
    assert torch.equal(update.tensors["w"], torch.full((8,), 3.0))
    assert r.stats()["versions_staged"] == 1


def test_quick_versions_end_at_the_newest(backend):
    make_b, make_r = backend
    b = make_b(bucket_bytes=1024)
    r = make_r(b)
    b.publish({"w": torch.zeros(4096)}, 1)
    r.commit(r.wait(1, WAIT_S).version)
    b.publish({"w": torch.full((4096,), 2.0)}, 2)
    b.publish({"w": torch.full((4096,), 3.0)}, 3)
    update = r.wait(3, WAIT_S)
    assert update is not None and update.version == 3
    assert torch.equal(update.tensors["w"], torch.full((4096,), 3.0))
    time.sleep(0.1)
    assert r.poll().version == 3  # nothing older replaces it


def test_versions_must_increase(backend):
    make_b, _ = backend
    b = make_b()
    b.publish({"w": torch.zeros(2)}, 5)
    with pytest.raises(ValueError, match=r"version=5 .* 5"):
        b.publish({"w": torch.zeros(2)}, 5)
    with pytest.raises(ValueError, match=r"version=4 .* 5"):
        b.publish({"w": torch.zeros(2)}, 4)
    with pytest.raises(ValueError, match="mode"):
        b.publish({"w": torch.zeros(2)}, 6, mode="half")  # type: ignore[arg-type]


def test_small_buckets_keep_every_tensor_intact(backend):
    make_b, make_r = backend
    sd = state_dict()
    buckets = plan_buckets(sd, 512)
    assert len(buckets) > 2
    assert sorted(s.name for bucket in buckets for s in bucket.slots) == sorted(sd)
    assert all(s.offset % 64 == 0 for bucket in buckets for s in bucket.slots)
    b = make_b(bucket_bytes=512)
    assert b.publish(sd, 1)["buckets"] == len(buckets)
    r = make_r(b)
    update = r.wait(1, WAIT_S)
    assert update.metadata["buckets"] == len(buckets)
    assert_same(update.tensors, sd)


def test_lora_mode_carries_config_and_only_the_adapters(backend):
    make_b, make_r = backend
    g = torch.Generator().manual_seed(1)
    adapters = {
        f"base_model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight": torch.randn(
            (4, 16) if ab == "A" else (16, 4), generator=g
        ).to(torch.bfloat16)
        for i in range(2)
        for p in ("q_proj", "v_proj")
        for ab in ("A", "B")
    }
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    b = make_b()
    with pytest.raises(ValueError, match="lora_config"):
        b.publish(adapters, 1, mode="full", lora_config=config)
    b.publish(adapters, 1, mode="lora", lora_config=config)
    update = make_r(b).wait(1, WAIT_S)
    assert update.mode == "lora" and update.lora_config == config
    assert_same(update.tensors, adapters)
    assert update.nbytes == sum(t.nbytes for t in adapters.values())


def test_corrupt_bucket_is_never_staged(backend):
    make_b, make_r = backend
    b = make_b(bucket_bytes=1024)
    r = make_r(b)
    b.publish({"w": torch.zeros(1024)}, 1)
    r.commit(r.wait(1, WAIT_S).version)
    corrupt_next(b, 1)
    b.publish({"w": torch.ones(1024), "v": torch.ones(512)}, 2)
    eventually(lambda: r.stats()["failures"] >= 1)
    assert r.poll() is None and r.wait(2, 0.2) is None
    stats = r.stats()
    assert stats["committed_version"] == 1 and stats["pending_version"] is None
    assert stats["recent_failures"][0]["version"] == 2 and "checksum" in stats["recent_failures"][0]["reason"]
    b.publish({"w": torch.full((1024,), 3.0)}, 3)  # the next clean version gets through
    update = r.wait(3, WAIT_S)
    assert update.version == 3 and torch.equal(update.tensors["w"], torch.full((1024,), 3.0))


def test_commit_shows_in_committed(backend):
    make_b, make_r = backend
    b = make_b()
    r0, r1 = make_r(b, "r0"), make_r(b, "r1")
    b.publish({"w": torch.zeros(3)}, 7)
    for r in (r0, r1):
        assert r.wait(7, WAIT_S).version == 7
    r0.commit(7)
    eventually(lambda: b.committed() == {"r0": 7})
    assert r0.poll() is None and r1.poll().version == 7
    with pytest.raises(ValueError, match="not newer"):
        r0.commit(7)
    with pytest.raises(ValueError, match="never staged"):
        r1.commit(8)
    r1.commit(7)
    eventually(lambda: b.committed() == {"r0": 7, "r1": 7})
    assert r1.stats()["versions_committed"] == 1


def test_factory_rejects_unknown_type():
    with pytest.raises(ValueError, match="'rdma'"):
        setup_weight_broadcaster("rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="receiver_id"):
        setup_weight_receiver("zmq", "tcp://127.0.0.1:1", receiver_id="../evil")


def test_zmq_receiver_start_times_out_naming_the_knob():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:  # bound, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        r = setup_weight_receiver("zmq", f"tcp://127.0.0.1:{port}", receiver_id="r0", timeout_s=0.3)
        with pytest.raises(WeightSyncError, match="timeout_s=0.3"):
            r.start()
        silent.close(linger=0)


def test_zmq_broadcaster_counts_and_drops_malformed_messages():
    b = setup_weight_broadcaster("zmq")
    try:
        b.publish({"w": torch.ones(4)}, 1)
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as rogue:
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(b.address)
            rogue.send_multipart([b"\xc1garbage"])
            rogue.send_multipart(encode("w_get", {"version": "1", "index": 0}))
            rogue.send_multipart(encode("w_commit", {"receiver_id": "../x", "version": 1}))
            eventually(lambda: b.stats()["bad_messages"] == 3)
        r = setup_weight_receiver("zmq", b.address, receiver_id="ok")
        r.start()
        assert r.wait(1, WAIT_S).version == 1  # still serving
        r.close()
    finally:
        b.close()


def test_shm_vanished_segment_is_a_failure(tmp_path):
    b = setup_weight_broadcaster("shm", directory=tmp_path)
    r = setup_weight_receiver("shm", b.address, receiver_id="r0")
    try:
        r.start()
        b.publish({"w": torch.ones(4)}, 1)
        r.commit(r.wait(1, WAIT_S).version)
        r._io.stop.set()  # pause the receiver's thread so the segment can vanish before it looks
        r._io.thread.join()
        b.publish({"w": torch.ones(4)}, 2)
        segment = orjson.loads((tmp_path / "latest.json").read_bytes())["segment"]
        (tmp_path / segment).unlink()
        r._io.stop.clear()
        r._check_once(time.monotonic())
        assert r.stats()["failures"] == 1 and "vanished" in r.stats()["recent_failures"][0]["reason"]
        assert r.poll() is None and r.committed_version == 1
        b.publish({"w": torch.full((4,), 3.0)}, 3)  # the broadcaster replaces a vanished segment
        r._check_once(time.monotonic() + 2)
        assert torch.equal(r.poll().tensors["w"], torch.full((4,), 3.0))
    finally:
        r.close()
        b.close()
    assert not list(tmp_path.glob("*.seg")) and (tmp_path / "committed-r0.json").exists()


def test_zmq_broadcaster_bind_failure_is_a_named_error():
    b = setup_weight_broadcaster("zmq")
    try:
        with pytest.raises(WeightSyncError, match="could not bind"):
            setup_weight_broadcaster("zmq", bind=b.address)  # address in use
    finally:
        b.close()
