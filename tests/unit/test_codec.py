"""Tests for asyncrl.codec: round-trips, frame types, encode errors, decode validation and fuzzing."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl import codec
from asyncrl.codec import (
    INLINE_MAX_BYTES,
    MAGIC,
    MAX_FRAMES,
    SCHEMA_VERSION,
    DecodeError,
    decode,
    dumps_json,
    encode,
    loads_json,
)
from asyncrl.rollout import Group, Rollout

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def roundtrip(body, kind="test", as_bytes=True):
    frames = encode(kind, body)
    if as_bytes:
        frames = [bytes(f) for f in frames]
    got_kind, got = decode(frames)
    assert got_kind == kind
    return got


def assert_tensor_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(a, b)


def make_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def header(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def msg(body, kind="k", version=SCHEMA_VERSION, magic=MAGIC) -> bytes:
    return header(magic, version, kind, body)


def tensor_ext(name, shape, ref, code=codec._EXT_TENSOR) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([name, shape, ref], use_bin_type=True))


def assert_decode_error(frames, **kw) -> None:
    with pytest.raises(DecodeError):
        decode(frames, **kw)


ALL_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.uint8,
]

# ----------------------------------------------------------------------------------------------------------------------
# round-trips


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [7, 4096], ids=["inline", "frame"])
def test_roundtrip_dtypes(dtype, numel):
    t = make_tensor(dtype, (numel,))
    frames = encode("t", {"x": t})
    if t.nbytes > INLINE_MAX_BYTES:
        assert len(frames) == 2
    else:
        assert len(frames) == 1
    _, body = decode([bytes(f) for f in frames])
    assert_tensor_equal(t, body["x"])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2)], ids=str)
def test_roundtrip_empty(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    frames = encode("t", t)
    assert len(frames) == 1
    assert_tensor_equal(t, decode(frames)[1])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_roundtrip_zero_dim(dtype):
    t = make_tensor(dtype, ()).reshape(())
    assert t.dim() == 0
    got = roundtrip(t)
    assert_tensor_equal(t, got)
    assert got.dim() == 0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_roundtrip_non_contiguous(dtype):
    base = make_tensor(dtype, (64, 48), seed=1)
    views = {
        "transposed": base.t(),
        "step": base[::3, 1::2],
        "column": base[:, 5],
        "expanded": make_tensor(dtype, (1, 5), seed=2).expand(200, 5),
        "small_step": base[:2, ::7],
    }
    for name, v in views.items():
        assert name == "small_step" or not v.is_contiguous()
        got = roundtrip({name: v})[name]
        assert_tensor_equal(v, got)


def test_large_tensor_travels_in_separate_frame_zero_copy():
    t = torch.arange(10_000, dtype=torch.int64)
    frames = encode("t", t)
    assert len(frames) == 2
    assert memoryview(frames[1]).nbytes == t.nbytes
    got = decode(frames)[1]
    assert_tensor_equal(t, got)
    # decoding aliases the received frame rather than copying it
    buf = bytearray(frames[1])
    got2 = decode([frames[0], buf])[1]
    assert got2.data_ptr() == np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_inline_boundary():
    at = torch.zeros(INLINE_MAX_BYTES, dtype=torch.uint8)
    over = torch.zeros(INLINE_MAX_BYTES + 1, dtype=torch.uint8)
    assert len(encode("t", at)) == 1
    assert len(encode("t", over)) == 2
    assert_tensor_equal(at, roundtrip(at))
    assert_tensor_equal(over, roundtrip(over))


def test_many_tensors_frame_order():
    ts = [torch.full((200 + i,), i, dtype=torch.int32) for i in range(10)]
    frames = encode("t", ts)
    assert len(frames) == 11
    got = roundtrip(ts)
    for a, b in zip(ts, got):
        assert_tensor_equal(a, b)


def test_tensor_requiring_grad_roundtrips():
    t = torch.randn(300, requires_grad=True)
    got = roundtrip(t)
    assert_tensor_equal(t.detach(), got)


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
)
@pytest.mark.parametrize("shape", [(5,), (300, 2), (0,), (0, 3), ()], ids=str)
def test_roundtrip_numpy(dtype, shape):
    rng = np.random.default_rng(0)
    a = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    assert isinstance(a, np.ndarray)
    frames = encode("np", {"a": a})
    assert len(frames) == (2 if a.nbytes > INLINE_MAX_BYTES else 1)
    got = decode([bytes(f) for f in frames])[1]["a"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == a.dtype
    assert got.shape == a.shape
    np.testing.assert_array_equal(got, a)


def test_roundtrip_numpy_non_contiguous():
    a = np.arange(600, dtype=np.float32).reshape(20, 30)
    for v in (a.T, a[::2, ::3], a[:, 3], a[::-1]):
        got = roundtrip(v)
        assert got.shape == v.shape and got.dtype == v.dtype
        np.testing.assert_array_equal(got, v)


@pytest.mark.parametrize("dtype", [">i4", ">f8", "<i2", ">i2", ">f2", "|u1"])
@pytest.mark.parametrize("n", [5, 300])
def test_roundtrip_numpy_non_native_byte_order(dtype, n):
    a = np.arange(n).astype(dtype)
    got = roundtrip(a)
    assert got.shape == a.shape
    np.testing.assert_array_equal(got, a)


def test_roundtrip_nested():
    body = {
        "a": [1, 2.5, "s", None, True, b"raw", {"t": torch.arange(5, dtype=torch.int32)}],
        "big": {"deep": [[torch.randn(1000)], {"np": np.arange(400, dtype=np.int64)}]},
        "tuple": (1, 2, torch.ones(3, dtype=torch.bool)),
        "scalars": {"i": np.int64(3), "f": np.float32(1.5), "b": np.bool_(True)},
        "empty": {},
    }
    frames = encode("nested", body)
    assert len(frames) == 3
    got = decode(frames)[1]
    assert got["a"][:6] == [1, 2.5, "s", None, True, b"raw"]
    assert_tensor_equal(body["a"][6]["t"], got["a"][6]["t"])
    assert_tensor_equal(body["big"]["deep"][0][0], got["big"]["deep"][0][0])
    np.testing.assert_array_equal(body["big"]["deep"][1]["np"], got["big"]["deep"][1]["np"])
    assert got["tuple"][:2] == [1, 2]
    assert_tensor_equal(body["tuple"][2], got["tuple"][2])
    assert got["scalars"] == {"i": 3, "f": 1.5, "b": True}
    assert got["empty"] == {}


def test_kind_roundtrips():
    for kind in ("", "group", "ünïcode"):
        assert decode(encode(kind, None)) == (kind, None)


# ----------------------------------------------------------------------------------------------------------------------
# frame types


def _encoded_mixed():
    body = {"small": torch.arange(4, dtype=torch.int32), "big": torch.randn(500), "np": np.arange(300.0)}
    return body, encode("mixed", body)


def _check_mixed(body, got):
    assert_tensor_equal(body["small"], got["small"])
    assert_tensor_equal(body["big"], got["big"])
    np.testing.assert_array_equal(body["np"], got["np"])


@pytest.mark.parametrize(
    "convert",
    [
        bytes,
        bytearray,
        lambda f: memoryview(bytes(f)),
        lambda f: zmq.Frame(bytes(f)),
        lambda f: f,  # as returned by encode
    ],
    ids=["bytes", "bytearray", "memoryview", "zmq.Frame", "native"],
)
def test_frame_types_decode(convert):
    body, frames = _encoded_mixed()
    assert len(frames) == 3
    kind, got = decode([convert(f) for f in frames])
    assert kind == "mixed"
    _check_mixed(body, got)


def test_frames_as_tuple_and_unaligned_memoryview():
    body, frames = _encoded_mixed()
    # each frame a slice at an odd offset of a larger buffer
    shifted = [memoryview(bytearray(b"x" + bytes(f)))[1:] for f in frames]
    _check_mixed(body, decode(tuple(shifted))[1])


@pytest.mark.parametrize("bad", ["a string", 12, None, 3.5, object()], ids=repr)
def test_non_buffer_frame_raises_decode_error(bad):
    _, frames = _encoded_mixed()
    assert_decode_error([frames[0], bad, frames[2]])
    assert_decode_error([bad])


# ----------------------------------------------------------------------------------------------------------------------
# encode errors


class Custom:
    pass


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        frozenset({1}),
        Custom(),
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(300, dtype=torch.complex128),
        np.zeros(3, dtype=np.complex64),
        np.array(["a", "b"]),
        np.array([object()], dtype=object),
        np.complex64(1 + 2j),
        lambda: 0,
    ],
    ids=lambda v: type(v).__name__,
)
def test_encode_unsupported_raises_type_error(value):
    with pytest.raises(TypeError):
        encode("bad", {"nested": [value]})


def test_encode_never_pickles(monkeypatch):
    import pickle

    def boom(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dumps", boom)
    monkeypatch.setattr(pickle, "dump", boom)
    with pytest.raises(TypeError):
        encode("bad", Custom())


# ----------------------------------------------------------------------------------------------------------------------
# decode validation (hand-built malformed messages)


def test_valid_hand_built_message_decodes():
    data = np.arange(10, dtype=np.int32).tobytes()
    got = decode([msg({"t": tensor_ext("int32", [10], 1)}), data])[1]
    assert_tensor_equal(torch.arange(10, dtype=torch.int32), got["t"])


def test_decode_empty_frame_list():
    assert_decode_error([])
    assert_decode_error(())


def test_decode_empty_header_frame():
    assert_decode_error([b""])


@pytest.mark.parametrize("magic", ["arL", "", "xyz", b"arl", 0, None, ["arl"]], ids=repr)
def test_decode_bad_magic(magic):
    assert_decode_error([msg({}, magic=magic)])


@pytest.mark.parametrize(
    "hdr",
    [
        [MAGIC, SCHEMA_VERSION, "k"],
        [MAGIC, SCHEMA_VERSION, "k", {}, "extra"],
        {"magic": MAGIC},
        "arl",
        42,
        None,
    ],
    ids=repr,
)
def test_decode_bad_header_shape(hdr):
    assert_decode_error([msgpack.packb(hdr)])


@pytest.mark.parametrize("version", [0, 2, SCHEMA_VERSION + 1, -1, "1", 1.0 + 1, None, True, [1]], ids=repr)
def test_decode_wrong_schema_version(version):
    if version == SCHEMA_VERSION and type(version) is int:  # pragma: no cover - guard against constant changes
        pytest.skip("same as current version")
    assert_decode_error([msg({}, version=version)])


@pytest.mark.parametrize("kind", [1, None, b"bytes-kind", ["k"], {"k": 1}, 1.5, True], ids=repr)
def test_decode_non_str_kind(kind):
    assert_decode_error([msg({}, kind=kind)])


@pytest.mark.parametrize("cut", [1, 2, 5, 10])
def test_decode_truncated_header(cut):
    frames = encode("k", {"a": list(range(20)), "t": torch.arange(5)})
    h = bytes(frames[0])
    assert_decode_error([h[:-cut]])


def test_decode_trailing_bytes_in_header():
    h = bytes(encode("k", {"a": 1})[0])
    assert_decode_error([h + b"\x00"])


def test_decode_extra_unreferenced_frame():
    frames = [bytes(f) for f in encode("k", {"t": torch.arange(200)})]
    assert len(frames) == 2
    assert_decode_error(frames + [b""])
    assert_decode_error(frames + [frames[1]])
    assert_decode_error([msg({}), b"orphan"])


@pytest.mark.parametrize("ref", [0, 2, 5, -1, 2**40], ids=repr)
def test_decode_frame_index_out_of_range(ref):
    data = np.zeros(4, dtype=np.int32).tobytes()
    assert_decode_error([msg(tensor_ext("int32", [4], ref)), data])


@pytest.mark.parametrize("ref", ["1", 1.0, None, True, b"\x01"], ids=repr)
def test_decode_frame_index_wrong_type(ref):
    data = np.zeros(4, dtype=np.int32).tobytes()
    assert_decode_error([msg(tensor_ext("int32", [4], ref)), data])


def test_decode_frame_referenced_twice():
    data = np.zeros(4, dtype=np.int32).tobytes()
    body = [tensor_ext("int32", [4], 1), tensor_ext("int32", [4], 1)]
    assert_decode_error([msg(body), data])
    assert_decode_error([msg(body), data, data])
    nd = [tensor_ext("int32", [4], 1, code=codec._EXT_NDARRAY), tensor_ext("int32", [4], 1)]
    assert_decode_error([msg(nd), data])


@pytest.mark.parametrize(
    "name,shape,nbytes",
    [
        ("int32", [4], 15),
        ("int32", [4], 17),
        ("int32", [4], 0),
        ("float64", [2, 3], 47),
        ("int32", [], 0),
        ("int32", [0], 4),
        ("bfloat16", [3], 3),
    ],
)
@pytest.mark.parametrize("code", [codec._EXT_TENSOR, codec._EXT_NDARRAY])
def test_decode_size_mismatch_frame(name, shape, nbytes, code):
    if code == codec._EXT_NDARRAY and name == "bfloat16":
        name = "float16"
    assert_decode_error([msg(tensor_ext(name, shape, 1, code=code)), b"\x00" * nbytes])


@pytest.mark.parametrize("code", [codec._EXT_TENSOR_INLINE, codec._EXT_NDARRAY_INLINE])
def test_decode_size_mismatch_inline(code):
    assert_decode_error([msg(tensor_ext("int32", [4], b"\x00" * 15, code=code))])
    assert_decode_error([msg(tensor_ext("int64", [2, 2], b"\x00" * 33, code=code))])


@pytest.mark.parametrize("name", ["complex64", "float128", "int", "", "object", 5, None, b"int32"], ids=repr)
@pytest.mark.parametrize("code", [codec._EXT_TENSOR, codec._EXT_NDARRAY])
def test_decode_unknown_dtype(name, code):
    assert_decode_error([msg(tensor_ext(name, [4], 1, code=code)), b"\x00" * 16])


def test_decode_numpy_has_no_bfloat16():
    assert_decode_error([msg(tensor_ext("bfloat16", [4], 1, code=codec._EXT_NDARRAY)), b"\x00" * 8])
    assert_decode_error([msg(tensor_ext("bfloat16", [4], b"\x00" * 8, code=codec._EXT_NDARRAY_INLINE))])


@pytest.mark.parametrize(
    "shape",
    [[-1], [4, -1], [-4], [2**40], [1.5], ["4"], [True, 4], None, 4, "4", [[4]], [1] * 9],
    ids=repr,
)
def test_decode_bad_shape(shape):
    assert_decode_error([msg(tensor_ext("uint8", shape, 1)), b"\x00" * 4])
    assert_decode_error([msg(tensor_ext("uint8", shape, b"\x00" * 4, code=codec._EXT_TENSOR_INLINE))])


def test_decode_huge_shape_product_is_size_mismatch():
    shape = [2**39] * 8
    assert_decode_error([msg(tensor_ext("float64", shape, 1)), b"\x00" * 8])
    # zero-sized with huge other dims: never allocates; either an empty tensor or DecodeError
    for code in (codec._EXT_TENSOR_INLINE, codec._EXT_NDARRAY_INLINE):
        for shape in ([0] + [2**39] * 7, [0, 2**39], [2**39, 0]):
            try:
                got = decode([msg(tensor_ext("float64", shape, b"", code=code))])[1]
            except DecodeError:
                continue
            assert got.size == 0 if isinstance(got, np.ndarray) else got.numel() == 0


def test_decode_inline_data_not_bytes():
    assert_decode_error([msg(tensor_ext("uint8", [1], 1, code=codec._EXT_TENSOR_INLINE)), b"\x00"])
    assert_decode_error([msg(tensor_ext("uint8", [1], "x", code=codec._EXT_TENSOR_INLINE))])


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.packb(["int32", [1]]), msgpack.packb(["int32", [1], 1, 2]), msgpack.packb({"a": 1}), b"\x93"],
    ids=repr,
)
def test_decode_malformed_tensor_ext_payload(payload):
    assert_decode_error([msg(msgpack.ExtType(codec._EXT_TENSOR, payload)), b"\x00" * 4])


@pytest.mark.parametrize("code", [0, 5, 42, 127])
def test_decode_unknown_ext_code(code):
    assert_decode_error([msg(msgpack.ExtType(code, b"whatever"))])


@pytest.mark.parametrize("code", [-5, -128, -1])
def test_decode_negative_ext_code(code):
    # msgpack.ExtType refuses negative (reserved) codes, so write fixext4 by hand; -1 with 4 bytes would be a
    # valid timestamp, so use fixext1 for it (an invalid timestamp)
    ext = (b"\xd4" + bytes([code & 0xFF]) + b"\x00") if code == -1 else (b"\xd6" + bytes([code & 0xFF]) + b"abcd")
    raw = b"\x94" + msgpack.packb(MAGIC) + msgpack.packb(SCHEMA_VERSION) + msgpack.packb("k") + ext
    assert_decode_error([raw])


def test_decode_total_size_over_max_message_bytes():
    frames = encode("k", {"t": torch.zeros(1000, dtype=torch.uint8)})
    total = sum(memoryview(f).nbytes for f in frames)
    decode(frames, max_message_bytes=total)
    assert_decode_error(frames, max_message_bytes=total - 1)
    assert_decode_error([msg({"s": "x" * 100})], max_message_bytes=50)


def test_decode_too_many_frames():
    assert_decode_error([msg({})] + [b""] * MAX_FRAMES)


def test_decode_max_frames_allowed():
    body = [tensor_ext("uint8", [0], i) for i in range(1, MAX_FRAMES)]
    frames = [msg(body)] + [b""] * (MAX_FRAMES - 1)
    assert len(frames) == MAX_FRAMES
    assert len(decode(frames)[1]) == MAX_FRAMES - 1


def test_decode_non_str_map_key():
    # msgpack with a non-str key
    assert_decode_error([msg({1: "a"})])
    assert_decode_error([msg({(1, 2): "a"})])


def test_decode_tensor_as_map_key():
    key = tensor_ext("uint8", [1], b"\x00", code=codec._EXT_TENSOR_INLINE)
    packed = msgpack.packb([MAGIC, SCHEMA_VERSION, "k", {key: 1}])
    assert_decode_error([packed])


def test_decode_deeply_nested_header():
    depth = 100_000
    data = b"\x91" * depth + b"\xc0"
    assert_decode_error([b"\x94" + msgpack.packb(MAGIC) + msgpack.packb(SCHEMA_VERSION) + msgpack.packb("k") + data])


def test_decode_invalid_utf8():
    # str8 header with invalid utf-8 payload
    bad = b"\x94" + msgpack.packb(MAGIC) + b"\x01" + b"\xa2\xff\xfe" + b"\xc0"
    assert_decode_error([bad])


@pytest.mark.parametrize(
    "value",
    [np.arange(2, dtype=np.int32), np.arange(1, dtype=np.int32), np.zeros(0, dtype=np.int32),
     torch.arange(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), np.int32(1)],
    ids=lambda v: f"{type(v).__name__}{getattr(v, 'shape', '')}",
)
@pytest.mark.parametrize("slot", ["magic", "version", "kind"])
def test_decode_tensor_in_header_slots(value, slot):
    """A peer can put an array/tensor where the magic, version or kind belong: always DecodeError."""
    code = codec._EXT_NDARRAY_INLINE if isinstance(value, np.ndarray) else codec._EXT_TENSOR_INLINE
    if isinstance(value, np.generic):
        ext = msgpack.ExtType(codec._EXT_NDARRAY_INLINE, msgpack.packb(["int32", [], value.tobytes()]))
    else:
        raw = value.numpy().tobytes() if isinstance(value, torch.Tensor) else value.tobytes()
        ext = msgpack.ExtType(code, msgpack.packb(["int32", list(value.shape), raw]))
    items = {"magic": MAGIC, "version": SCHEMA_VERSION, "kind": "k"}
    items[slot] = ext
    assert_decode_error([msgpack.packb([items["magic"], items["version"], items["kind"], {}])])


# ----------------------------------------------------------------------------------------------------------------------
# fuzzing


def _group(seed: int = 0) -> Group:
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for s in range(2):
        n = 150 + 10 * s  # response tensors over INLINE_MAX_BYTES -> separate frames
        rollouts.append(
            Rollout(
                epoch=1,
                prompt_index=7,
                sample_index=s,
                worker_id=f"w{s}",
                policy_version=3,
                prompt_ids=torch.randint(0, 1000, (9,), generator=g, dtype=torch.int32),
                response_ids=torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
                logprobs=-torch.rand(n, generator=g),
                loss_mask=torch.ones(n, dtype=torch.bool),
                version_spans=[(3, 0, 50), (4, 50, n)],
                reward=0.5 * s,
                reward_components={"acc": 1.0},
                finish_reason="stop",
                timings={"generate": 0.1},
                metadata={"tag": "x", "n": s},
            )
        )
    return Group(epoch=1, prompt_index=7, rollouts=rollouts)


GROUP_FRAMES = [bytes(f) for f in encode("group", _group().to_wire())]
GROUP_SIZE = 2


def test_group_frames_fixture_is_valid():
    assert len(GROUP_FRAMES) > 1
    kind, body = decode(GROUP_FRAMES)
    assert kind == "group"
    g = Group.from_wire(body, group_size=GROUP_SIZE)
    assert [r.sample_index for r in g.rollouts] == [0, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_fuzz_random_frames(frames):
    try:
        decode(frames)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_fuzz_random_body_after_valid_prefix(frames):
    # a valid header prefix followed by random bytes reaches the body parser more often
    head = b"\x94" + msgpack.packb(MAGIC) + msgpack.packb(SCHEMA_VERSION) + msgpack.packb("k")
    try:
        decode([head + frames[0], *frames[1:]])
    except DecodeError:
        pass


_ext_payload = st.one_of(
    st.binary(max_size=24),
    st.builds(
        lambda name, shape, ref: msgpack.packb([name, shape, ref]),
        st.sampled_from(["int32", "float32", "bool", "uint8", "bfloat16", "float64", "nope", ""])
        | st.integers(-(2**63), 2**63 - 1),
        st.lists(st.integers(-2, 5), max_size=3) | st.integers(-(2**63), 2**63 - 1),
        st.integers(-1, 4) | st.binary(max_size=16) | st.none() | st.booleans(),
    ),
)
# well-formed inline tensors/arrays, so the fuzzer also puts real tensors in every slot of the header
_valid_inline_ext = st.builds(
    lambda code, n: msgpack.ExtType(code, msgpack.packb(["int32", [n], b"\x01\x00\x00\x00" * n])),
    st.sampled_from([codec._EXT_TENSOR_INLINE, codec._EXT_NDARRAY_INLINE]),
    st.integers(0, 3),
)
_msgpack_leaf = (
    _valid_inline_ext
    | st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 6), _ext_payload)
)
_msgpack_value = st.recursive(
    _msgpack_leaf,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    magic=st.just(MAGIC) | _msgpack_leaf,
    version=st.just(SCHEMA_VERSION) | _msgpack_leaf,
    kind=st.just("k") | _msgpack_leaf,
    body=_msgpack_value,
    extra=st.lists(st.binary(max_size=40), max_size=4),
)
def test_fuzz_structured_headers(magic, version, kind, body, extra):
    frames = [msgpack.packb([magic, version, kind, body]), *extra]
    try:
        decode(frames)
    except DecodeError:
        pass


_MUTATIONS = ("flip", "truncate", "duplicate", "drop", "swap", "extend", "shrink_len")


@st.composite
def mutated_group_frames(draw):
    frames = [bytearray(f) for f in GROUP_FRAMES]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(_MUTATIONS))
        if not frames:
            frames.append(bytearray())
            continue
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if op == "flip":
            # bias towards the header, where the structure lives
            i = 0 if draw(st.booleans()) else i
            f = frames[i]
            for _ in range(draw(st.integers(1, 8))):
                if f:
                    pos = draw(st.integers(0, len(f) - 1))
                    f[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            frames[i] = f[: draw(st.integers(0, max(0, len(f) - 1)))]
        elif op == "duplicate":
            frames.insert(draw(st.integers(0, len(frames))), bytearray(f))
        elif op == "drop":
            del frames[i]
        elif op == "swap":
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "extend":
            frames[i] = f + draw(st.binary(min_size=1, max_size=16))
        elif op == "shrink_len":
            k = draw(st.integers(1, 8))
            frames[i] = f[:-k] if len(f) > k else bytearray()
    return [bytes(f) for f in frames]


@settings(max_examples=300, deadline=None)
@given(mutated_group_frames())
def test_fuzz_mutated_group(frames):
    try:
        kind, body = decode(frames)
        Group.from_wire(body, group_size=GROUP_SIZE)
    except DecodeError:
        pass


# ----------------------------------------------------------------------------------------------------------------------
# JSON


def test_json_roundtrip_numpy_scalars():
    obj = {
        "i64": np.int64(3),
        "i32": np.int32(-4),
        "u8": np.uint8(255),
        "f32": np.float32(1.5),
        "f64": np.float64(2.25),
        "b": np.bool_(True),
        "arr": np.arange(3),
        "nested": {"x": [np.float64(0.5), 1, "s", None]},
        1: "int key",
    }
    data = dumps_json(obj)
    assert isinstance(data, bytes)
    got = loads_json(data)
    assert got == {
        "i64": 3,
        "i32": -4,
        "u8": 255,
        "f32": 1.5,
        "f64": 2.25,
        "b": True,
        "arr": [0, 1, 2],
        "nested": {"x": [0.5, 1, "s", None]},
        "1": "int key",
    }
    assert loads_json(data.decode()) == got
