"""Delta updates through the zmq backend (broadcaster and receivers in this process, loopback tcp): deltas
against the committed version, full buckets for a late joiner, a rolled-back incarnation and a receiver that
lies about its base or whose base bytes changed (refused by name, healed by the full bucket), LoRA mode, and
the bytes counted on both ends."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.weights import setup_weight_broadcaster, setup_weight_receiver
from asyncrl.weights._checksum import fill_bucket
from asyncrl.weights.base import plan_buckets
from asyncrl.weights.delta import DeltaCodec
from asyncrl.weights.zmq import ZmqWeightReceiver

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

KB = 1 << 10
WAIT_S = 30.0


def weights(seed: int = 0, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}
    out["norm.weight"] = torch.ones(256)  # fp32 beside bf16: compared as 2-byte words
    return out


def step(tensors: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """A small optimizer-like step: ``fraction`` of the elements move a little."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return out


def staged(receiver, version: int, incarnation: str | None = None):
    update = receiver.wait(version, WAIT_S, incarnation=incarnation)
    assert update is not None, receiver.stats()
    return update


def same(update, tensors) -> bool:
    return update.tensors.keys() == tensors.keys() and all(torch.equal(update.tensors[k], t) for k, t in tensors.items())


def wait_for(cond, what) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.01)


@pytest.fixture
def broadcaster():
    b = setup_weight_broadcaster("zmq", bucket_bytes=64 * KB, delta=True)
    yield b
    b.close()


@pytest.fixture
def receivers():
    opened = []

    def make(address, receiver_id, cls=ZmqWeightReceiver, **kw):
        r = cls(address, receiver_id=receiver_id, delta=True, **kw)
        r.start()
        opened.append(r)
        return r

    yield make
    for r in opened:
        r.close()


def apply(receiver, version, tensors, incarnation=None):
    update = staged(receiver, version, incarnation)
    assert same(update, tensors)
    receiver.commit(update.version)
    return update


def test_second_version_travels_as_deltas_and_is_exact(broadcaster, receivers):
    v1 = weights()
    v2 = step(v1, 1)
    broadcaster.publish(v1, 1)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, v1)
    first = r.stats()
    assert first.get("buckets_delta", 0) == 0 and first["full_bytes"] > 0  # nothing to be a delta against
    full = first["full_bytes"]  # the broadcaster counts a bucket after sending it: its count may still be behind
    wait_for(lambda: broadcaster.stats()["bytes_served"] == full, lambda: f"v1 counted alike: {broadcaster.stats()}")
    broadcaster.publish(v2, 2)
    apply(r, 2, v2)
    s = r.stats()
    assert s["buckets_delta"] > 0 and s.get("delta_refused", 0) == 0
    wire = s["delta_bytes"] + s["full_bytes"] - first["full_bytes"]  # the broadcaster counts after each send:
    wait_for(lambda: broadcaster.stats()["bytes_served"] - full == wire,
             lambda: f"bytes counted alike on both ends: {wire=} {full=} receiver {r.stats()} "
                     f"broadcaster {broadcaster.stats()}")
    assert s["delta_bytes"] * 5 < full, (s, full)
    assert broadcaster.stats()["deltas_encoded"] >= s["buckets_delta"]


def test_late_joiner_and_receivers_without_deltas_get_full_buckets(broadcaster, receivers):
    v1, v2 = weights(), step(weights(), 1)
    broadcaster.publish(v1, 1)
    early = receivers(broadcaster.address, "early")
    apply(early, 1, v1)
    broadcaster.publish(v2, 2)
    late = receivers(broadcaster.address, "late")
    plain = setup_weight_receiver("zmq", broadcaster.address, receiver_id="plain")  # delta=False
    plain.start()
    try:
        for r in (early, late, plain):
            apply(r, 2, v2)
        assert early.stats()["buckets_delta"] > 0
        assert late.stats().get("buckets_delta", 0) == 0 and plain.stats().get("buckets_delta", 0) == 0
        v3 = step(v2, 2)
        broadcaster.publish(v3, 3)
        for r in (early, late, plain):
            apply(r, 3, v3)
        assert late.stats()["buckets_delta"] > 0  # from its first commit on, it has a base
        assert plain.stats().get("buckets_delta", 0) == 0
    finally:
        plain.close()


def test_skipped_versions_come_full_once_the_base_is_gone(broadcaster, receivers):
    v = [weights()]
    for i in range(1, 4):
        v.append(step(v[-1], i))
    broadcaster.publish(v[0], 1)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, v[0])
    full_before = r.stats()["buckets_full"]
    broadcaster.publish(v[1], 2)  # (the receiver may fetch some of it as deltas before version 3 replaces it)
    buckets = broadcaster.publish(v[2], 3)["buckets"]  # keep_versions=2: version 1, the receiver's base, is gone
    apply(r, 3, v[2])
    assert r.stats()["buckets_full"] - full_before >= buckets  # every bucket of version 3 came full
    assert broadcaster.stats().get("deltas_base_not_held", 0) >= buckets


def test_rolled_back_incarnation_gets_full_buckets_then_deltas(broadcaster, receivers):
    a5 = weights()
    broadcaster.publish(a5, 5, incarnation="A")
    r = receivers(broadcaster.address, "w0")
    apply(r, 5, a5, "A")
    b3 = step(a5, 7)  # the resumed run reuses version numbers below the dead one's
    broadcaster.publish(b3, 6, incarnation="B")
    apply(r, 6, b3, "B")  # base (A, 5) is held by the broadcaster: a delta is fine and exact
    b = [b3]
    # now the broadcaster forgets A entirely and republishes from B's own history
    for version in (7, 8):
        b.append(step(b[-1], version))
        broadcaster.publish(b[-1], version, incarnation="B")
        apply(r, version, b[-1], "B")
    s = r.stats()
    assert s["buckets_delta"] > 0 and s.get("delta_refused", 0) == 0


class LyingReceiver(ZmqWeightReceiver):
    """Names the version before the one it committed as its base (a confused or rolled-back worker)."""

    def _base_fields(self):
        fields = super()._base_fields()
        if fields:
            fields["base_version"] -= 1
        return fields


def test_a_receiver_that_lies_about_its_base_is_refused_and_healed(receivers):
    b = setup_weight_broadcaster("zmq", bucket_bytes=64 * KB, delta=True, keep_versions=3)
    try:
        v1 = weights()
        v2, v3 = step(v1, 1), step(step(v1, 1), 2)
        b.publish(v1, 1)
        liar = receivers(b.address, "liar", cls=LyingReceiver)
        apply(liar, 1, v1)
        b.publish(v2, 2)
        apply(liar, 2, v2)  # names base 0, which nobody holds: full
        b.publish(v3, 3)
        apply(liar, 3, v3)  # names base 1 (kept here), holds 2: every delta refused, every bucket healed
    finally:
        b.close()
    s = liar.stats()
    assert s["delta_refused"] > 0 and s["delta_refused"] == s["delta_refused_base_mismatch"]
    assert s.get("failures", 0) == 0


def test_base_bytes_that_differ_fail_the_checksum_and_heal(broadcaster, receivers):
    v1 = weights()
    v2 = step(v1, 1)
    broadcaster.publish(v1, 1)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, v1)
    wait_for(lambda: r._delta_base.key() == (1, ""), "base adopted")
    r._delta_base._base[3][0][100] ^= 0x01  # its base is not what it says (memory went bad, a bug elsewhere)
    broadcaster.publish(v2, 2)
    apply(r, 2, v2)
    s = r.stats()
    assert s["delta_refused_checksum_mismatch"] == 1 and s["buckets_delta"] > 0 and s.get("failures", 0) == 0


def test_lora_adapters_travel_as_deltas(broadcaster, receivers):
    g = torch.Generator().manual_seed(0)
    a1 = {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": (torch.randn(8, 256, generator=g) * 0.02)
          .to(torch.bfloat16) for i in range(4) for ab in "AB"}
    a2 = step(a1, 3)
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    broadcaster.publish(a1, 1, mode="lora", lora_config=lora)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, a1)
    broadcaster.publish(a2, 2, mode="lora", lora_config=lora)
    update = apply(r, 2, a2)
    assert update.mode == "lora" and update.lora_config == lora
    assert r.stats()["buckets_delta"] > 0


def test_lora_receivers_without_the_adapter_base_get_full_buckets(broadcaster, receivers):
    """fp32 adapters (PEFT's dtype) after a full-weights version: a receiver whose committed base is the full
    version (another layout) and a late joiner (no base) get the adapter buckets full, exact, nothing refused;
    the next adapter version travels as deltas to both."""
    g = torch.Generator().manual_seed(0)
    a1 = {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(8, 256, generator=g) * 0.02
          for i in range(4) for ab in "AB"}
    a2, a3 = step(a1, 3), step(step(a1, 3), 4)
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    v1 = weights()
    broadcaster.publish(v1, 1)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, v1)  # its base: the full weights
    broadcaster.publish(a2, 2, mode="lora", lora_config=lora)
    full_before = r.stats()["buckets_full"]
    apply(r, 2, a2)
    late = receivers(broadcaster.address, "late")  # no base at all
    assert apply(late, 2, a2).mode == "lora"
    for rr, full in ((r, r.stats()["buckets_full"] - full_before), (late, late.stats()["buckets_full"])):
        s = rr.stats()
        assert full > 0 and s.get("buckets_delta", 0) == 0, s
        assert not any(k.startswith("delta_refused") and v for k, v in s.items()) and s.get("failures", 0) == 0, s
    broadcaster.publish(a3, 3, mode="lora", lora_config=lora)
    for rr in (r, late):
        assert apply(rr, 3, a3).mode == "lora" and rr.stats()["buckets_delta"] > 0, rr.stats()


def test_broadcaster_without_deltas_ignores_named_bases(receivers):
    b = setup_weight_broadcaster("zmq", bucket_bytes=64 * KB)
    try:
        v1 = weights()
        b.publish(v1, 1)
        r = receivers(b.address, "w0")
        apply(r, 1, v1)
        v2 = step(v1, 1)
        b.publish(v2, 2)
        apply(r, 2, v2)
        assert r.stats().get("buckets_delta", 0) == 0 and b.stats().get("delta_bytes", 0) == 0
    finally:
        b.close()


def test_buckets_are_encoded_once_at_publish_for_every_receiver_at_that_base(broadcaster, receivers):
    v1 = weights()
    v2, v3 = step(v1, 1), step(step(v1, 1), 2)
    broadcaster.publish(v1, 1)
    rs = [receivers(broadcaster.address, f"w{i}") for i in range(2)]
    for r in rs:
        apply(r, 1, v1)
    broadcaster.publish(v2, 2)
    for r in rs:
        apply(r, 2, v2)
    assert all(r.stats()["buckets_delta"] > 0 for r in rs)
    before = broadcaster.stats()["deltas_encoded"]
    for r in rs:
        r.close()  # nobody asks for version 3: its deltas are encoded as the publish writes each bucket
    buckets = broadcaster.publish(v3, 3)["buckets"]
    wait_for(lambda: broadcaster.stats()["deltas_encoded"] - before == buckets, lambda: broadcaster.stats())
    late = receivers(broadcaster.address, "w0")  # w0 again, with no base: full, and nothing encoded for it
    apply(late, 3, v3)
    assert late.stats().get("buckets_delta", 0) == 0 and broadcaster.stats()["deltas_encoded"] - before == buckets


def test_an_encode_that_fails_serves_the_bucket_full(broadcaster, receivers, monkeypatch):
    from asyncrl.weights import zmq as zmq_weights

    real = zmq_weights.encode_delta

    def first_bucket_fails(codec, bucket, *args, **kwargs):
        if bucket.index == 0:
            raise MemoryError("encode of bucket 0 failed")
        return real(codec, bucket, *args, **kwargs)

    monkeypatch.setattr(zmq_weights, "encode_delta", first_bucket_fails)
    v1 = weights()
    v2 = step(v1, 1)
    broadcaster.publish(v1, 1)
    r = receivers(broadcaster.address, "w0")
    apply(r, 1, v1)
    full_before = r.stats()["buckets_full"]
    buckets = broadcaster.publish(v2, 2)["buckets"]
    apply(r, 2, v2)  # exact, bucket 0 full and the rest as deltas
    s, b = r.stats(), broadcaster.stats()
    assert s["buckets_full"] - full_before == 1 and s["buckets_delta"] == buckets - 1 and s.get("failures", 0) == 0
    assert b["delta_encode_errors"] >= 1


def _gated_encodes(monkeypatch, base_version: int):
    """Encodes against ``base_version`` wait for ``gate`` (after setting ``started``): an encode in flight."""
    import threading

    from asyncrl.weights import zmq as zmq_weights

    real, started, gate = zmq_weights.encode_delta, threading.Event(), threading.Event()

    def gated(codec, bucket, *args, **kwargs):
        if kwargs["base_version"] == base_version:
            started.set()
            gate.wait(WAIT_S)
        return real(codec, bucket, *args, **kwargs)

    monkeypatch.setattr(zmq_weights, "encode_delta", gated)
    return started, gate


def _second_version_encoding(b, receivers, v1, v2, started):
    """Version 1 published and committed by receiver w0, then version 2 published with its first encode (against 1)
    started and held by ``_gated_encodes``: the moment the hostile tests below act in. Returns the receiver."""
    b.publish(v1, 1)
    r = receivers(b.address, "w0")
    apply(r, 1, v1)
    wait_for(lambda: b.committed().get("w0") == 1, lambda: b.stats())
    b.publish(v2, 2)
    assert started.wait(WAIT_S), b.stats()
    return r


def test_close_with_an_encode_in_flight_returns_and_the_encoder_thread_ends(receivers, monkeypatch):
    """close() while an encode runs longer than the join allows: close returns, the encode's late wake-up of the
    closed I/O thread is no error (and opens no socket that would hang the context), the thread then ends, and
    what the receiver staged is exact."""
    from asyncrl._zmq import io as _zmq_io

    monkeypatch.setattr(_zmq_io, "JOIN_S", 1.0)  # the encode outlives the encoder's join
    started, gate = _gated_encodes(monkeypatch, base_version=1)
    b = setup_weight_broadcaster("zmq", bucket_bytes=64 * KB, delta=True)
    v1 = weights()
    v2 = step(v1, 1)
    try:
        r = _second_version_encoding(b, receivers, v1, v2, started)
    finally:
        t0 = time.monotonic()
        b.close()
    assert time.monotonic() - t0 < WAIT_S
    gate.set()
    threads = [t.thread for t in b._encoder._threads]
    wait_for(lambda: not any(t.is_alive() for t in threads), "encoder thread still running after close")
    assert b.stats().get("delta_encode_errors", 0) == 0, b.stats()
    update = r.wait(2, 0.5)
    assert update is None or (update.version == 2 and same(update, v2))
    assert not any(k.startswith("delta_refused") and v for k, v in r.stats().items()), r.stats()


def test_a_publish_while_the_previous_versions_encodes_run_never_mixes_them(receivers, monkeypatch):
    """Version 3 is published while version 2's encodes (against 1) are held: its publish reuses version 1's
    buffers only once no encode reads them, version 2's remaining encodes find their base retired and serve
    full, and receivers end exact on 2 and 3 with nothing refused."""
    import threading

    started, gate = _gated_encodes(monkeypatch, base_version=1)
    b = setup_weight_broadcaster("zmq", bucket_bytes=64 * KB, delta=True, keep_versions=2)
    v1 = weights()
    v2 = step(v1, 1)
    v3 = step(v2, 2)
    try:
        r = _second_version_encoding(b, receivers, v1, v2, started)
        published = threading.Event()
        t = threading.Thread(target=lambda: (b.publish(v3, 3), published.set()), daemon=True)
        t.start()  # retires version 1, whose buffers an encode of version 2 reads now
        assert not published.wait(0.3), "version 3 reused version 1's buffers while an encode read them"
        gate.set()
        t.join(WAIT_S)
        assert published.is_set(), b.stats()
        entry = next(v for v in b._versions if v.manifest.version == 2)
        base = {x.index: x for x in plan_buckets(v1, 64 * KB)}
        with b._lock:
            made = {key: d for key, d in entry.deltas.items() if d is not None}
        assert made and all(key[1:] == (1, "") for key in made), entry.deltas.keys()
        for (index, _, _), d in made.items():  # each against version 1's bytes as published (verified inside)
            held = torch.empty(base[index].nbytes, dtype=torch.uint8)
            fill_bucket(base[index], v1, held)
            DeltaCodec().decode(d, held.numpy(), base_version=1, base_incarnation="")
        update = r.wait(3, WAIT_S)  # version 2 first (if it came before 3's manifest), then 3
        assert update is not None and update.version == 3 and same(update, v3), r.stats()
        r.commit(3)
        s, bs = r.stats(), b.stats()
        assert not any(k.startswith("delta_refused") and v for k, v in s.items()) and s.get("failures", 0) == 0, s
        assert bs.get("delta_encode_errors", 0) == 0 and bs["versions"] == [2, 3], bs
    finally:
        b.close()


def test_a_bucket_whose_deltas_are_not_smaller_is_served_full_without_encoding_until_a_probe(broadcaster, receivers):
    """Weights that change whole (here: fresh random ones every version) make every delta as big as its bucket; after
    DENSE_AFTER such deltas in a row a bucket is served full without the encode, except on probing versions
    (PROBE_EVERY), and a probe that finds the changes sparse again brings the deltas back."""
    from asyncrl.weights.zmq import DENSE_AFTER, PROBE_EVERY

    def noise(seed: int) -> dict[str, torch.Tensor]:  # random bits in every word: no delta is smaller than the bucket
        g = torch.Generator().manual_seed(seed)
        out = {}
        for name, t in weights().items():
            width = t.element_size() * 8
            bits = torch.randint(-(1 << (width - 1)), 1 << (width - 1), t.shape, generator=g, dtype=torch.int64)
            v = bits.to(torch.int16 if width == 16 else torch.int32).view(t.dtype)
            out[name] = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
        return out

    r = receivers(broadcaster.address, "w0")
    current = noise(1)
    broadcaster.publish(current, 1)
    apply(r, 1, current)
    buckets = len(plan_buckets(current, 64 * KB))
    for version in range(2, PROBE_EVERY):  # dense: fresh weights each version, no probe before PROBE_EVERY
        current = noise(version)
        broadcaster.publish(current, version)
        apply(r, version, current)
    s = broadcaster.stats()
    dense_versions = PROBE_EVERY - 2  # versions 2 .. PROBE_EVERY - 1 were sent against a base
    assert s.get("deltas_encoded", 0) == 0 and s["deltas_not_smaller"] == DENSE_AFTER * buckets, s
    assert s["deltas_skipped_dense"] == (dense_versions - DENSE_AFTER) * buckets, s
    assert r.stats().get("buckets_delta", 0) == 0

    sparse = step(current, 99)  # a small step, published on the probing version: deltas again
    broadcaster.publish(sparse, PROBE_EVERY)
    apply(r, PROBE_EVERY, sparse)
    after = step(sparse, 100)
    broadcaster.publish(after, PROBE_EVERY + 1)
    apply(r, PROBE_EVERY + 1, after)
    s = broadcaster.stats()
    assert s["deltas_encoded"] == 2 * buckets and s["deltas_skipped_dense"] == (dense_versions - DENSE_AFTER) * buckets, s
    assert r.stats()["buckets_delta"] == 2 * buckets
