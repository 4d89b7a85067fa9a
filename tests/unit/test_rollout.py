"""Tests for asyncrl.rollout: the Rollout/Group schema and its wire validation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.codec import DecodeError, decode, encode
from asyncrl.rollout import FINISH_REASONS, MAX_TOKENS, Group, Rollout, make_group_id, make_uid

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def make_rollout(
    *,
    epoch: int = 1,
    prompt_index: int = 2,
    sample_index: int = 0,
    prompt_len: int = 6,
    response_len: int = 10,
    seed: int | None = None,
    **overrides: Any,
) -> Rollout:
    """A valid rollout; deterministic in (epoch, prompt_index, sample_index) unless ``seed`` is given."""
    g = torch.Generator().manual_seed(seed if seed is not None else hash((epoch, prompt_index, sample_index)) % 2**31)
    kw: dict[str, Any] = dict(
        epoch=epoch,
        prompt_index=prompt_index,
        sample_index=sample_index,
        worker_id="worker-0",
        policy_version=3,
        prompt_ids=torch.randint(0, 32000, (prompt_len,), generator=g, dtype=torch.int32),
        response_ids=torch.randint(0, 32000, (response_len,), generator=g, dtype=torch.int32),
        logprobs=-torch.rand(response_len, generator=g, dtype=torch.float32) * 5,
        loss_mask=torch.ones(response_len, dtype=torch.bool),
        version_spans=[(3, 0, response_len // 2), (4, response_len // 2, response_len)],
        reward=1.0,
        reward_components={"correct": 1.0, "format": 0.0},
        finish_reason="stop",
        timings={"generate": 0.25, "reward": 0.01},
        metadata={"source": "unit", "turns": 1},
    )
    kw.update(overrides)
    return Rollout(**kw)


def make_group(n: int = 4, *, epoch: int = 1, prompt_index: int = 2, **kw: Any) -> Group:
    rollouts = [make_rollout(epoch=epoch, prompt_index=prompt_index, sample_index=i, **kw) for i in range(n)]
    return Group(epoch=epoch, prompt_index=prompt_index, rollouts=rollouts)


def over_wire(body: Any, kind: str = "msg") -> Any:
    """Encodes and decodes ``body`` (bytes frames, as a socket would deliver them)."""
    frames = [bytes(f) for f in encode(kind, body)]
    got_kind, got = decode(frames)
    assert got_kind == kind
    return got


def rollout_over_wire(r: Rollout) -> Rollout:
    return Rollout.from_wire(over_wire(r.to_wire(), "rollout"))


def assert_wire_rejects(d: dict) -> None:
    """The rollout wire dict ``d`` must be rejected with DecodeError after a real encode/decode."""
    body = over_wire(d, "rollout")
    with pytest.raises(DecodeError):
        Rollout.from_wire(body)


def assert_rollout_equal(a: Rollout, b: Rollout) -> None:
    for name in ("epoch", "prompt_index", "sample_index", "worker_id", "policy_version", "reward", "finish_reason"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_ids", "response_ids", "logprobs", "loss_mask"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    assert [tuple(s) for s in a.version_spans] == b.version_spans
    assert a.reward_components == b.reward_components
    assert a.timings == b.timings
    assert a.metadata == b.metadata
    assert a.uid == b.uid and a.group_id == b.group_id


# ----------------------------------------------------------------------------------------------------------------------
# ids


def test_make_uid_and_group_id():
    assert make_uid(1, 2, 3) == "e1-p2-s3"
    assert make_group_id(1, 2) == "e1-p2"
    r = make_rollout(epoch=1, prompt_index=2, sample_index=3)
    assert r.uid == "e1-p2-s3"
    assert r.group_id == "e1-p2"


def test_uid_deterministic_for_regenerated_rollout():
    a = make_rollout(epoch=5, prompt_index=9, sample_index=1, seed=1, worker_id="a", policy_version=3)
    b = make_rollout(epoch=5, prompt_index=9, sample_index=1, seed=2, worker_id="b", response_len=4,
                     version_spans=[(7, 0, 4)], policy_version=7)
    assert a.uid == b.uid == "e5-p9-s1"
    assert rollout_over_wire(b).uid == a.uid
    assert make_rollout(sample_index=2).uid != make_rollout(sample_index=1).uid


# ----------------------------------------------------------------------------------------------------------------------
# round-trips


def test_rollout_roundtrip():
    r = make_rollout()
    assert r.version_spans == [(3, 0, 5), (4, 5, 10)]
    r.validate()
    got = rollout_over_wire(r)
    assert_rollout_equal(r, got)
    assert got.version_spans == [(3, 0, 5), (4, 5, 10)]
    assert got.spans() == [(3, 0, 5), (4, 5, 10)]
    assert got.num_tokens == 16
    assert got.nbytes == r.nbytes


def test_rollout_roundtrip_minimal():
    r = make_rollout(loss_mask=None, version_spans=[], reward_components={}, timings={}, metadata={})
    got = rollout_over_wire(r)
    assert_rollout_equal(r, got)
    assert got.loss_mask is None
    assert got.spans() == [(3, 0, 10)]


def test_rollout_roundtrip_large_tensors_use_frames():
    r = make_rollout(prompt_len=1000, response_len=2000)
    frames = encode("rollout", r.to_wire())
    assert len(frames) > 1
    assert_rollout_equal(r, Rollout.from_wire(decode([bytes(f) for f in frames])[1]))


def test_rollout_roundtrip_empty_response():
    r = make_rollout(response_len=0, version_spans=[], loss_mask=torch.ones(0, dtype=torch.bool))
    assert_rollout_equal(r, rollout_over_wire(r))


def test_rollout_roundtrip_int64_ids_and_env_tokens():
    r = make_rollout()
    r.prompt_ids = r.prompt_ids.long()
    r.response_ids = r.response_ids.long()
    r.loss_mask = torch.tensor([True] * 4 + [False] * 3 + [True] * 3)
    r.logprobs = torch.where(r.loss_mask, r.logprobs, torch.zeros_like(r.logprobs))
    assert_rollout_equal(r, rollout_over_wire(r))


@pytest.mark.parametrize("reason", FINISH_REASONS)
def test_rollout_all_finish_reasons(reason):
    assert rollout_over_wire(make_rollout(finish_reason=reason)).finish_reason == reason


def test_group_roundtrip():
    g = make_group(4)
    g.validate(4)
    body = over_wire(g.to_wire(), "group")
    got = Group.from_wire(body, group_size=4)
    assert got.epoch == g.epoch and got.prompt_index == g.prompt_index and got.group_id == "e1-p2"
    assert len(got.rollouts) == 4
    for a, b in zip(g.rollouts, got.rollouts):
        assert_rollout_equal(a, b)
    assert got.policy_version == 3
    assert got.num_tokens == g.num_tokens
    assert got.nbytes == g.nbytes
    # group_size is optional
    assert len(Group.from_wire(body).rollouts) == 4


def test_group_roundtrip_unordered_samples():
    g = make_group(3)
    g.rollouts.reverse()
    got = Group.from_wire(over_wire(g.to_wire()), group_size=3)
    assert [r.sample_index for r in got.rollouts] == [2, 1, 0]


# ----------------------------------------------------------------------------------------------------------------------
# rollout rejections


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_reject_non_finite_logprob(bad):
    r = make_rollout()
    r.logprobs = r.logprobs.clone()
    r.logprobs[3] = bad
    assert_wire_rejects(r.to_wire())


def test_reject_positive_logprob():
    r = make_rollout()
    r.logprobs = r.logprobs.clone()
    r.logprobs[0] = 0.5
    assert_wire_rejects(r.to_wire())


def test_logprob_zero_is_accepted():
    r = make_rollout(logprobs=torch.zeros(10))
    assert_rollout_equal(r, rollout_over_wire(r))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0", None, True, [1.0]], ids=repr)
def test_reject_bad_reward(bad):
    d = make_rollout().to_wire()
    d["reward"] = bad
    assert_wire_rejects(d)


@pytest.mark.parametrize("field", ["reward_components", "timings"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, "x", None], ids=repr)
def test_reject_bad_float_maps(field, bad):
    d = make_rollout().to_wire()
    d[field] = {"k": bad}
    assert_wire_rejects(d)


@pytest.mark.parametrize("field", ["reward_components", "timings", "metadata"])
def test_reject_non_map(field):
    d = make_rollout().to_wire()
    d[field] = [1.0]
    assert_wire_rejects(d)


@pytest.mark.parametrize("n", [9, 11, 0])
def test_reject_logprobs_length_mismatch(n):
    d = make_rollout().to_wire()
    d["logprobs"] = -torch.ones(n)
    assert_wire_rejects(d)


@pytest.mark.parametrize("n", [9, 11, 0])
def test_reject_loss_mask_length_mismatch(n):
    d = make_rollout().to_wire()
    d["loss_mask"] = torch.ones(n, dtype=torch.bool)
    assert_wire_rejects(d)


@pytest.mark.parametrize(
    "spans",
    [
        [[3, 0, 5], [4, 6, 10]],  # gap
        [[3, 0, 6], [4, 5, 10]],  # overlap
        [[3, 0, 5], [4, 5, 9]],  # short
        [[3, 0, 5], [4, 5, 11]],  # long
        [[3, 1, 10]],  # not starting at 0
        [[4, 5, 10], [3, 0, 5]],  # out of order
        [[3, 0, 7], [4, 7, 5], [4, 5, 10]],  # end < start
        [[3, 0, 5], [4, 5]],  # malformed span
        [[3, 0, 5], [4, 5, 10.0]],  # non-int
        [[3, 0, 5], [True, 5, 10]],  # bool
        [[3, 0, 5], "4,5,10"],
        "spans",
        None,
    ],
    ids=repr,
)
def test_reject_bad_version_spans(spans):
    d = make_rollout().to_wire()
    d["version_spans"] = spans
    assert_wire_rejects(d)


def test_reject_policy_version_not_oldest_span():
    d = make_rollout().to_wire()
    d["policy_version"] = 4
    assert_wire_rejects(d)
    d = make_rollout().to_wire()
    d["version_spans"] = [[5, 0, 5], [4, 5, 10]]  # oldest is 4, policy_version is 3
    assert_wire_rejects(d)


def test_policy_version_is_oldest_span_even_if_not_first():
    r = make_rollout(policy_version=2, version_spans=[(5, 0, 3), (2, 3, 8), (6, 8, 10)])
    assert rollout_over_wire(r).policy_version == 2


@pytest.mark.parametrize("reason", ["STOP", "eos", "", "x" * 300, 1, None], ids=repr)
def test_reject_unknown_finish_reason(reason):
    d = make_rollout().to_wire()
    d["finish_reason"] = reason
    assert_wire_rejects(d)


@pytest.mark.parametrize("field", sorted(make_rollout().to_wire().keys() - {"incarnation"}))
def test_reject_missing_field(field):
    d = make_rollout().to_wire()
    del d[field]
    assert_wire_rejects(d)


def test_incarnation_is_optional_and_bounded():
    d = make_rollout().to_wire()
    del d["incarnation"]
    assert Rollout.from_wire(over_wire(d, "rollout")).incarnation == ""  # an older sender: judged by version alone
    d["incarnation"] = "x" * 65
    assert_wire_rejects(d)


@pytest.mark.parametrize("extra", ["extra", "Uid", "advantage"])
def test_reject_unknown_extra_field(extra):
    d = make_rollout().to_wire()
    d[extra] = 1
    assert_wire_rejects(d)


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", -torch.ones(10, dtype=torch.float64)),
        ("logprobs", -torch.ones(10, dtype=torch.float16)),
        ("logprobs", -torch.ones(10, dtype=torch.bfloat16)),
        ("logprobs", torch.zeros(10, dtype=torch.int32)),
        ("prompt_ids", torch.zeros(6, dtype=torch.float32)),
        ("prompt_ids", torch.zeros(6, dtype=torch.int16)),
        ("response_ids", torch.zeros(10, dtype=torch.uint8)),
        ("response_ids", torch.zeros(10, dtype=torch.bool)),
        ("loss_mask", torch.ones(10, dtype=torch.uint8)),
        ("loss_mask", torch.ones(10, dtype=torch.float32)),
    ],
    ids=lambda v: str(v.dtype) if isinstance(v, torch.Tensor) else v,
)
def test_reject_wrong_dtype(field, value):
    d = make_rollout().to_wire()
    d[field] = value
    assert_wire_rejects(d)


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", -torch.ones(2, 5)),
        ("logprobs", -torch.ones(1, 10)),
        ("response_ids", torch.zeros(10, 1, dtype=torch.int32)),
        ("prompt_ids", torch.zeros(2, 3, dtype=torch.int32)),
        ("prompt_ids", torch.tensor(5, dtype=torch.int32)),  # 0-d
        ("loss_mask", torch.ones(2, 5, dtype=torch.bool)),
    ],
    ids=lambda v: str(tuple(v.shape)) if isinstance(v, torch.Tensor) else v,
)
def test_reject_wrong_ndim(field, value):
    d = make_rollout().to_wire()
    d[field] = value
    assert_wire_rejects(d)


@pytest.mark.parametrize("field", ["prompt_ids", "response_ids", "logprobs", "loss_mask"])
@pytest.mark.parametrize("value", [[1, 2, 3], "ids", 5], ids=repr)
def test_reject_non_tensor(field, value):
    d = make_rollout().to_wire()
    d[field] = value
    assert_wire_rejects(d)


def test_reject_numpy_instead_of_tensor():
    d = make_rollout().to_wire()
    d["response_ids"] = d["response_ids"].numpy()
    assert_wire_rejects(d)


@pytest.mark.parametrize(
    "uid,group_id",
    [
        ("e9-p9-s9", "e1-p2"),
        ("e1-p2-s1", "e1-p2"),  # sample_index is 0
        ("e1-p2-s0", "e1-p3"),
        ("e1-p2-s0", None),
        (None, "e1-p2"),
        (b"e1-p2-s0", "e1-p2"),
        (0, "e1-p2"),
    ],
    ids=repr,
)
def test_reject_uid_mismatch(uid, group_id):
    d = make_rollout(epoch=1, prompt_index=2, sample_index=0).to_wire()
    assert d["uid"] == "e1-p2-s0"
    d["uid"], d["group_id"] = uid, group_id
    assert_wire_rejects(d)


@pytest.mark.parametrize(
    "value",
    [np.arange(2, dtype=np.int32), np.zeros(0, dtype=np.int32), np.arange(1, dtype=np.int32),
     torch.arange(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)],
    ids=lambda v: f"{type(v).__name__}{tuple(v.shape)}",
)
@pytest.mark.parametrize("field", ["uid", "group_id"])
def test_reject_array_as_uid(field, value):
    """A peer can send an array where the uid belongs: DecodeError, not numpy's truth-value error."""
    d = make_rollout().to_wire()
    d[field] = value
    assert_wire_rejects(d)


def test_uid_changed_with_fields_is_rejected():
    # changing sample_index without changing the uid must be caught
    d = make_rollout(sample_index=0).to_wire()
    d["sample_index"] = 1
    assert_wire_rejects(d)


@pytest.mark.parametrize("field", ["epoch", "prompt_index", "sample_index", "policy_version"])
@pytest.mark.parametrize("value", [-1, "1", 1.0, None, True, 2**63], ids=repr)
def test_reject_bad_ints(field, value):
    d = make_rollout(version_spans=[]).to_wire()
    d[field] = value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and field != "policy_version":
        # keep ids consistent so the int check itself is what rejects
        r = make_rollout(version_spans=[])
        d["uid"] = make_uid(*(value if f == field else getattr(r, f) for f in ("epoch", "prompt_index", "sample_index")))
        d["group_id"] = make_group_id(*(value if f == field else getattr(r, f) for f in ("epoch", "prompt_index")))
    assert_wire_rejects(d)


def test_reject_negative_ids_even_if_consistent():
    r = make_rollout(epoch=-1, version_spans=[])
    assert_wire_rejects(r.to_wire())


@pytest.mark.parametrize("value", [1, "x" * 257, None], ids=repr)
def test_reject_bad_worker_id(value):
    d = make_rollout().to_wire()
    d["worker_id"] = value
    assert_wire_rejects(d)


def test_reject_non_str_map_keys():
    d = make_rollout().to_wire()
    d["timings"] = {b"generate": 0.1}
    assert_wire_rejects(d)


@pytest.mark.parametrize("value", [None, [], "rollout", 3])
def test_reject_non_map_rollout(value):
    with pytest.raises(DecodeError):
        Rollout.from_wire(over_wire(value))


def test_reject_too_many_tokens():
    n = MAX_TOKENS + 1 - 6
    r = make_rollout(response_len=0, version_spans=[], loss_mask=None)
    d = r.to_wire()
    d["response_ids"] = torch.zeros(n, dtype=torch.int32)
    d["logprobs"] = torch.zeros(n, dtype=torch.float32)
    assert_wire_rejects(d)


def test_validate_rejects_direct_construction():
    r = make_rollout()
    r.logprobs = r.logprobs.clone()
    r.logprobs[0] = math.nan
    with pytest.raises(DecodeError):
        r.validate()


# ----------------------------------------------------------------------------------------------------------------------
# group rejections


def group_wire(g: Group) -> Any:
    return over_wire(g.to_wire(), "group")


def test_reject_group_duplicate_sample_index():
    g = make_group(2)
    g.rollouts[1] = make_rollout(sample_index=0, seed=99)
    body = group_wire(g)
    with pytest.raises(DecodeError):
        Group.from_wire(body, group_size=2)
    with pytest.raises(DecodeError):
        Group.from_wire(body)


def test_reject_group_sample_index_out_of_range():
    g = make_group(2)
    g.rollouts[1] = make_rollout(sample_index=5)
    with pytest.raises(DecodeError):
        Group.from_wire(group_wire(g), group_size=2)


@pytest.mark.parametrize("group_size", [1, 3, 0])
def test_reject_group_wrong_group_size(group_size):
    body = group_wire(make_group(2))
    with pytest.raises(DecodeError):
        Group.from_wire(body, group_size=group_size)


def test_reject_group_rollout_from_another_prompt():
    g = make_group(3, prompt_index=2)
    g.rollouts[1] = make_rollout(prompt_index=5, sample_index=1)
    with pytest.raises(DecodeError):
        Group.from_wire(group_wire(g), group_size=3)
    g = make_group(3, epoch=1)
    g.rollouts[2] = make_rollout(epoch=2, sample_index=2)
    with pytest.raises(DecodeError):
        Group.from_wire(group_wire(g), group_size=3)


def test_reject_empty_group():
    g = Group(epoch=1, prompt_index=2, rollouts=[])
    with pytest.raises(DecodeError):
        Group.from_wire(group_wire(g))


def test_reject_group_with_invalid_rollout():
    g = make_group(2)
    g.rollouts[1].logprobs = g.rollouts[1].logprobs.clone()
    g.rollouts[1].logprobs[0] = math.nan
    with pytest.raises(DecodeError):
        Group.from_wire(group_wire(g), group_size=2)


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"epoch": 1, "prompt_index": 2},
        {"epoch": 1, "prompt_index": 2, "rollouts": "x"},
        {"epoch": "1", "prompt_index": 2, "rollouts": []},
        {"epoch": 1, "prompt_index": None, "rollouts": []},
        {"epoch": 1, "prompt_index": 2, "rollouts": [None]},
        {"epoch": 1, "prompt_index": 2, "rollouts": [{}]},
    ],
    ids=repr,
)
def test_reject_malformed_group(body):
    with pytest.raises(DecodeError):
        Group.from_wire(over_wire(body), group_size=1)
