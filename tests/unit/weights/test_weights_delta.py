"""Bucket deltas (asyncrl.weights.delta): round trips over bf16/fp16/fp32 buckets with sparse and dense
changes, refusals of a wrong base, a malformed payload and a lying receiver's base, each named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.weights import plan_buckets
from asyncrl.weights.base import bucket_checksum
from asyncrl.weights.delta import BucketDelta, DeltaCodec, DeltaRefused, delta_word, same_layout

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def _step(base: torch.Tensor, fraction: float, scale: float, seed: int) -> torch.Tensor:
    """``base`` with ``fraction`` of its elements moved by ``scale`` relative (as an optimizer step would)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(base.shape, generator=g) < fraction
    moved = (base.float() * (1 + scale * torch.randn(base.shape, generator=g))).to(base.dtype)
    return torch.where(mask, moved, base)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(DTYPES)), n=st.integers(0, 5000), fraction=st.sampled_from([0.0, 1e-3, 0.02, 0.3, 1.0]),
       scale=st.sampled_from([1e-3, 1e-1, 10.0]), seed=st.integers(0, 2**16))
def test_round_trip(dtype, n, fraction, scale, seed):
    base_t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DTYPES[dtype])
    new_t = _step(base_t, fraction, scale, seed + 1)
    base, new = _bytes(base_t), _bytes(new_t)
    word = base_t.element_size()
    codec = DeltaCodec()
    delta = codec.encode(new, base, word=word, base_version=3, base_incarnation="inc")
    if delta is None:  # the full bucket is not larger: nothing to check but that it really is not
        return
    assert delta.wire_nbytes < new.nbytes
    wire = BucketDelta.from_wire(delta.header(), delta.payload.copy())
    out = DeltaCodec().decode(wire, base, base_version=3, base_incarnation="inc")
    assert np.array_equal(out, new)
    assert delta.checksum == bucket_checksum(memoryview(new))


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.02, 0.2, 0.9])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sparse_and_dense_changes_round_trip_and_shrink(dtype, fraction):
    base_t = (torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 0.02).to(DTYPES[dtype])
    new_t = _step(base_t, fraction, 1e-3, 2)
    base, new = _bytes(base_t), _bytes(new_t)
    delta = DeltaCodec().encode(new, base, word=base_t.element_size(), base_version=1, base_incarnation="")
    assert delta is not None, "small relative changes always beat the full bucket"
    if fraction <= 0.02:
        assert delta.encoding == "sparse" and delta.wire_nbytes * 20 < new.nbytes
    out = np.empty_like(new)
    DeltaCodec().decode(delta, base, base_version=1, base_incarnation="", out=out)
    assert np.array_equal(out, new)


def test_dense_random_bucket_is_sent_full():
    rng = np.random.default_rng(0)
    base, new = rng.integers(0, 256, 1 << 16, dtype=np.uint8), rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    assert DeltaCodec().encode(new, base, word=2, base_version=1, base_incarnation="") is None


def test_xor_encoding_round_trips():
    base_t = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    new_t = _step(base_t, 0.9, 1e-6, 4)  # nearly every element, only the low mantissa bits
    base, new = _bytes(base_t), _bytes(new_t)
    delta = DeltaCodec(threads=2).encode(new, base, word=4, base_version=7, base_incarnation="a")
    assert delta is not None and delta.encoding in ("xor", "sparse")
    assert np.array_equal(DeltaCodec().decode(delta, base, base_version=7, base_incarnation="a"), new)


def _pair(seed=0):
    base_t = torch.randn(50_000, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    base, new = _bytes(base_t), _bytes(_step(base_t, 0.02, 1e-2, seed + 1))
    return base, new, DeltaCodec().encode(new, base, word=2, base_version=5, base_incarnation="live")


@pytest.mark.parametrize("held", [(4, "live"), (None, ""), (5, "dead"), (6, "live")])
def test_wrong_base_is_refused_by_name(held):
    base, _, delta = _pair()
    with pytest.raises(DeltaRefused) as e:
        DeltaCodec().decode(delta, base, base_version=held[0], base_incarnation=held[1])
    assert e.value.reason == "base_mismatch" and "version 5" in str(e.value)


def test_a_receiver_that_lies_about_its_base_gets_a_checksum_refusal():
    _, _, delta = _pair()
    other, _, _ = _pair(seed=9)  # claims (5, "live") but holds other bytes, e.g. a rolled-back run's
    with pytest.raises(DeltaRefused) as e:
        DeltaCodec().decode(delta, other, base_version=5, base_incarnation="live")
    assert e.value.reason == "checksum_mismatch"


@pytest.mark.parametrize("tamper", ["flip_payload", "truncate", "count", "split", "bomb", "encoding", "word"])
def test_malformed_deltas_are_refused(tamper):
    base, _, delta = _pair()
    header, payload = delta.header(), delta.payload.copy()
    if tamper == "flip_payload":
        payload[payload.size // 2] ^= 0xFF
    elif tamper == "truncate":
        payload = payload[:-3]
    elif tamper == "count":
        header["count"] += 1
    elif tamper == "split":
        header["split"] = payload.size + 1
    elif tamper == "bomb":
        import zstandard

        payload = np.frombuffer(zstandard.ZstdCompressor().compress(bytes(1 << 24)), dtype=np.uint8)
        header.update(encoding="xor", split=0, count=0)
    elif tamper == "encoding":
        header["encoding"] = "pickle"
    else:
        header["word"] = 3
    with pytest.raises(DeltaRefused) as e:
        DeltaCodec().decode(BucketDelta.from_wire(header, payload), base, base_version=5, base_incarnation="live")
    assert e.value.reason in ("malformed", "checksum_mismatch")


def test_scattered_positions_out_of_range_are_malformed():
    import zstandard

    base = np.zeros(64, dtype=np.uint8)
    c = zstandard.ZstdCompressor()
    gaps = np.array([100], dtype=np.uint32)  # beyond the 32 words
    z = c.compress(gaps.tobytes())
    payload = np.frombuffer(z + c.compress(np.array([1], dtype=np.uint16).tobytes()), dtype=np.uint8)
    d = BucketDelta(encoding="sparse", base_version=1, base_incarnation="", word=2, nbytes=64, checksum=0, count=1,
                    split=len(z), payload=payload)
    with pytest.raises(DeltaRefused) as e:
        DeltaCodec().decode(d, base, base_version=1, base_incarnation="")
    assert e.value.reason == "malformed"


def test_word_and_layout_of_buckets():
    tensors = {"a": torch.zeros(10, dtype=torch.float32), "b": torch.zeros(7, dtype=torch.bfloat16)}
    (bucket,) = plan_buckets(tensors, 1 << 20)
    assert delta_word(bucket) == 2
    (other,) = plan_buckets({**tensors, "b": torch.zeros(8, dtype=torch.bfloat16)}, 1 << 20)
    assert same_layout(bucket, bucket) and not same_layout(bucket, other)
    (flags,) = plan_buckets({"m": torch.zeros(5, dtype=torch.bool), **tensors}, 1 << 20)
    assert delta_word(flags) == 1


def _buckets(tensors):
    buckets = plan_buckets(tensors, 1 << 16)
    buffers = []
    for b in buckets:
        buffers.append(torch.zeros(b.nbytes, dtype=torch.uint8))
        for s in b.slots:
            buffers[-1][s.offset : s.offset + s.nbytes].view(tensors[s.name].dtype).copy_(tensors[s.name].view(-1))
        b.checksum = bucket_checksum(memoryview(buffers[-1].numpy()))
    return buckets, buffers


def test_encode_apply_through_the_receivers_base():
    from asyncrl.weights.delta import DeltaBase, apply_bucket, encode_bucket

    g = torch.Generator().manual_seed(0)
    v1 = {f"w{i}": (torch.randn(20_000, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    v2 = {k: _step(t, 0.02, 1e-2, i) for i, (k, t) in enumerate(v1.items())}
    b1, d1 = _buckets(v1)
    b2, d2 = _buckets(v2)
    base, given = DeltaBase(), []
    assert base.key() == (None, "")
    base.release(1, "inc", b2, d2, lambda: given.append("staged, superseded"), committed=False)
    assert given == ["staged, superseded"] and base.key() == (None, "")
    base.release(1, "inc", b1, d1, lambda: given.append("v1"), committed=True)
    assert base.key() == (1, "inc") and given == ["staged, superseded"]
    codec = DeltaCodec()
    for b, data, bb, bd in zip(b2, d2, b1, d1):
        delta = encode_bucket(codec, b, data, bb, bd, base_version=1, base_incarnation="inc")
        assert delta is not None and delta.wire_nbytes * 10 < b.nbytes
        out = apply_bucket(codec, base, b, delta.header(), torch.from_numpy(delta.payload.copy()))
        assert torch.equal(out, data)
    # another layout (a tensor grew) is no base: encode says "send it full", apply refuses
    b3, d3 = _buckets({**v2, "w0": torch.zeros(20_001, dtype=torch.bfloat16)})
    assert encode_bucket(codec, b3[0], d3[0], b1[0], d1[0], base_version=1, base_incarnation="inc") is None
    delta = encode_bucket(codec, b2[0], d2[0], b1[0], d1[0], base_version=1, base_incarnation="inc")
    with pytest.raises(DeltaRefused) as e:
        apply_bucket(codec, base, b3[0], delta.header(), delta.payload)
    assert e.value.reason in ("base_mismatch", "malformed")
    # a checksum announced apart from the delta that disagrees with it is refused
    with pytest.raises(DeltaRefused) as e:
        apply_bucket(codec, base, b2[0], delta.header(), delta.payload, checksum=b2[0].checksum ^ 1)
    assert e.value.reason == "malformed"
    # a new base gives the old one's buffers back; a dropped base means everything comes full
    base.release(2, "inc", b2, d2, lambda: given.append("v2"), committed=True)
    assert base.key() == (2, "inc") and given[-1] == "v1"
    base.drop()
    assert base.key() == (None, "") and given[-1] == "v2"
    with pytest.raises(DeltaRefused) as e:
        apply_bucket(codec, base, b2[0], delta.header(), delta.payload)
    assert e.value.reason == "base_mismatch"


def _numpy_only(monkeypatch):
    from asyncrl.weights import _delta_kernels

    monkeypatch.setattr(_delta_kernels, "available", lambda: False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(word=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 3000), fraction=st.sampled_from([0.0, 1e-3, 0.03, 0.1, 0.6]),
       seed=st.integers(0, 2**16))
def test_compiled_and_numpy_paths_encode_and_decode_alike(monkeypatch, word, n, fraction, seed):
    """The compiled kernels and the numpy path make the same payload and rebuild the same bytes, for every word
    width, sizes not a multiple of 8 bytes and densities past the kernels' scratch (KERNEL_DENSITY)."""
    from asyncrl.weights import _delta_kernels

    if not _delta_kernels.available():
        pytest.skip("numba is not installed: only the numpy path exists")
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * word, dtype=np.uint8)
    new = base.copy()
    changed = rng.random(n * word) < fraction
    new[changed] ^= rng.integers(1, 256, int(changed.sum()), dtype=np.uint8)
    kw = {"word": word, "base_version": 1, "base_incarnation": ""}
    compiled = DeltaCodec().encode(new, base, **kw)
    with monkeypatch.context() as m:
        _numpy_only(m)
        plain = DeltaCodec().encode(new, base, **kw)
        assert (compiled is None) == (plain is None)
        if plain is None:
            return
        assert compiled.header() == plain.header() and np.array_equal(compiled.payload, plain.payload)
        out_numpy = DeltaCodec().decode(plain, base, base_version=1, base_incarnation="")
    out_compiled = DeltaCodec().decode(compiled, base, base_version=1, base_incarnation="")
    assert np.array_equal(out_numpy, new) and np.array_equal(out_compiled, new)


@pytest.mark.parametrize("gaps", [[100], [3, 0], [0, 5, 40]], ids=["beyond", "repeated", "beyond_later"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_bad_positions_are_malformed_on_both_paths(monkeypatch, gaps, compiled):
    import zstandard

    from asyncrl.weights import _delta_kernels

    if compiled and not _delta_kernels.available():
        pytest.skip("numba is not installed")
    if not compiled:
        _numpy_only(monkeypatch)
    from asyncrl.weights.delta import _shuffle

    c = zstandard.ZstdCompressor()
    z = c.compress(_shuffle(np.array(gaps, dtype=np.uint32)).tobytes())
    z_values = c.compress(_shuffle(np.ones(len(gaps), dtype=np.uint16)).tobytes())
    d = BucketDelta(encoding="sparse", base_version=1, base_incarnation="", word=2, nbytes=64, checksum=0,
                    count=len(gaps), split=len(z), payload=np.frombuffer(z + z_values, dtype=np.uint8))
    with pytest.raises(DeltaRefused, match="not increasing or beyond") as e:
        DeltaCodec().decode(d, np.zeros(64, dtype=np.uint8), base_version=1, base_incarnation="")
    assert e.value.reason == "malformed"
