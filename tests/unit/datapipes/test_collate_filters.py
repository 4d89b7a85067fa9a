"""Tests for datapipes.collate.collate_groups, datapipes.filters.GroupFilter and asyncrl.config."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchdata.nodes import BaseNode, Loader

from asyncrl.config import (
    EngineConfig,
    FakeEngineConfig,
    LoaderConfig,
    TransportConfig,
    WorkerConfig,
    from_dict,
    to_dict,
)
from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups
from datapipes.filters import GroupFilter, has_reward_variance

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def rollout(
    prompt: list[int],
    response: list[int],
    *,
    epoch: int = 0,
    prompt_index: int = 0,
    sample_index: int = 0,
    policy_version: int = 0,
    logprobs: list[float] | None = None,
    loss_mask: list[bool] | None = None,
    version_spans: list[tuple[int, int, int]] | None = None,
    reward: float = 0.0,
    worker_id: str = "w0",
) -> Rollout:
    n = len(response)
    lp = logprobs if logprobs is not None else [-(i + 1) / 10 for i in range(n)]
    r = Rollout(
        epoch=epoch,
        prompt_index=prompt_index,
        sample_index=sample_index,
        worker_id=worker_id,
        policy_version=policy_version,
        prompt_ids=torch.tensor(prompt, dtype=torch.int32),
        response_ids=torch.tensor(response, dtype=torch.int32),
        logprobs=torch.tensor(lp, dtype=torch.float32),
        loss_mask=None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool),
        version_spans=list(version_spans or []),
        reward=reward,
    )
    r.validate()
    return r


def group_of(prompt_index: int, rewards: list[float], epoch: int = 0) -> Group:
    rs = [
        rollout([prompt_index + 1, 7], [100 + s, 200 + s], epoch=epoch, prompt_index=prompt_index, sample_index=s,
                reward=rw)
        for s, rw in enumerate(rewards)
    ]
    return Group(epoch=epoch, prompt_index=prompt_index, rollouts=rs)


# ----------------------------------------------------------------------------------------------------------------------
# collate_groups


def _two_groups() -> list[Group]:
    g0 = Group(
        epoch=1,
        prompt_index=5,
        rollouts=[
            rollout([11, 12, 13], [21, 22, 23, 24, 25], epoch=1, prompt_index=5, sample_index=0, policy_version=3,
                    version_spans=[(3, 0, 2), (4, 2, 5)], reward=1.0,
                    logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5]),
            rollout([11, 12, 13], [31, 32], epoch=1, prompt_index=5, sample_index=1, policy_version=4,
                    reward=0.0, logprobs=[-1.0, -2.0], worker_id="w1"),
        ],
    )
    g1 = Group(
        epoch=1,
        prompt_index=9,
        rollouts=[
            # multi-turn: tokens 2..3 come from the environment
            rollout([41], [51, 52, 53, 54, 55, 56], epoch=1, prompt_index=9, sample_index=0, policy_version=2,
                    loss_mask=[True, True, False, False, True, True],
                    logprobs=[-0.5, -0.6, 0.0, 0.0, -0.7, -0.8], reward=0.5),
            rollout([41], [61], epoch=1, prompt_index=9, sample_index=1, policy_version=2, reward=-0.5,
                    logprobs=[-3.0]),
        ],
    )
    return [g0, g1]


def test_collate_shapes_and_rows():
    groups = _two_groups()
    b = collate_groups(groups, pad_token_id=-7)
    assert b["input_ids"].shape == (4, 8)  # 3+5, 3+2, 1+6, 1+1 -> max 8
    for key in ("attention_mask", "loss_mask", "rollout_logprobs", "token_versions"):
        assert b[key].shape == (4, 8), key
    assert b["input_ids"].dtype == torch.long
    assert b["attention_mask"].dtype == torch.bool and b["loss_mask"].dtype == torch.bool
    assert b["rollout_logprobs"].dtype == torch.float32
    assert b["input_ids"].tolist() == [
        [11, 12, 13, 21, 22, 23, 24, 25],
        [11, 12, 13, 31, 32, -7, -7, -7],
        [41, 51, 52, 53, 54, 55, 56, -7],
        [41, 61, -7, -7, -7, -7, -7, -7],
    ]
    assert b["attention_mask"].tolist() == [
        [True] * 8,
        [True] * 5 + [False] * 3,
        [True] * 7 + [False],
        [True] * 2 + [False] * 6,
    ]
    assert b["group_index"].tolist() == [0, 0, 1, 1]
    assert b["group_ids"] == ["e1-p5", "e1-p9"]
    assert b["uids"] == ["e1-p5-s0", "e1-p5-s1", "e1-p9-s0", "e1-p9-s1"]
    assert b["worker_ids"] == ["w0", "w1", "w0", "w0"]
    assert b["rewards"].dtype == torch.float32 and b["rewards"].tolist() == [1.0, 0.0, 0.5, -0.5]
    assert b["policy_versions"].tolist() == [3, 4, 2, 2]
    assert b["prompt_lengths"].tolist() == [3, 3, 1, 1]
    assert b["response_lengths"].tolist() == [5, 2, 6, 1]
    assert b["num_tokens"] == 8 + 5 + 7 + 2


def test_collate_loss_mask_logprobs_and_versions():
    b = collate_groups(_two_groups())
    F, T = False, True
    assert b["loss_mask"].tolist() == [
        [F, F, F, T, T, T, T, T],
        [F, F, F, T, T, F, F, F],
        [F, T, T, F, F, T, T, F],  # environment tokens are not trained on
        [F, T, F, F, F, F, F, F],
    ]
    expected_lp = torch.tensor(
        [
            [0, 0, 0, -0.1, -0.2, -0.3, -0.4, -0.5],
            [0, 0, 0, -1.0, -2.0, 0, 0, 0],
            [0, -0.5, -0.6, 0, 0, -0.7, -0.8, 0],
            [0, -3.0, 0, 0, 0, 0, 0, 0],
        ],
        dtype=torch.float32,
    )
    assert torch.equal(b["rollout_logprobs"], expected_lp)
    assert b["token_versions"].tolist() == [
        [-1, -1, -1, 3, 3, 4, 4, 4],  # spans [(3,0,2),(4,2,5)]
        [-1, -1, -1, 4, 4, -1, -1, -1],  # implicit single span of policy_version
        [-1, 2, 2, 2, 2, 2, 2, -1],
        [-1, 2, -1, -1, -1, -1, -1, -1],
    ]
    # logprobs sit exactly under the response tokens they belong to
    for row, g_r in enumerate(r for g in _two_groups() for r in g.rollouts):
        p, n = g_r.prompt_ids.numel(), g_r.response_ids.numel()
        assert torch.equal(b["input_ids"][row, p : p + n], g_r.response_ids.long())
        assert torch.equal(b["rollout_logprobs"][row, p : p + n], g_r.logprobs)


def test_collate_empty_response_and_single_group():
    g = Group(
        epoch=0,
        prompt_index=0,
        rollouts=[rollout([1, 2], [], sample_index=0), rollout([1, 2], [3], sample_index=1)],
    )
    b = collate_groups([g])
    assert b["input_ids"].tolist() == [[1, 2, 0], [1, 2, 3]]
    assert b["loss_mask"].tolist() == [[False] * 3, [False, False, True]]
    assert b["token_versions"].tolist() == [[-1, -1, -1], [-1, -1, 0]]


def test_collate_empty_raises():
    with pytest.raises(ValueError):
        collate_groups([])


# ----------------------------------------------------------------------------------------------------------------------
# GroupFilter


class ListNode(BaseNode[Group]):
    """Deterministic in-memory source of groups with state {"i": idx}."""

    def __init__(self, groups: list[Group]):
        super().__init__()
        self.groups = groups
        self.i = 0

    def reset(self, initial_state: dict[str, Any] | None = None):
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self) -> Group:
        if self.i >= len(self.groups):
            raise StopIteration
        g = self.groups[self.i]
        self.i += 1
        return g

    def get_state(self) -> dict[str, Any]:
        return {"i": self.i}


# prompts 1, 3, 4, 7, 9 have reward variance; 0, 2, 5, 6, 8 do not
REWARDS = {
    0: [1.0, 1.0],
    1: [0.0, 1.0],
    2: [0.0, 0.0],
    3: [0.5, 0.25],
    4: [1.0, 1.0 + 1e-6],
    5: [0.3, 0.3],
    6: [2.0, 2.0],
    7: [-1.0, 1.0],
    8: [0.0, 0.0],
    9: [0.0, 0.1],
}
KEPT = [1, 3, 4, 7, 9]


def source_groups() -> list[Group]:
    return [group_of(i, REWARDS[i]) for i in range(10)]


def test_has_reward_variance():
    assert not has_reward_variance(group_of(0, [1.0, 1.0, 1.0]))
    assert has_reward_variance(group_of(0, [1.0, 0.0, 1.0]))
    assert not has_reward_variance(group_of(0, [0.5]))
    assert not has_reward_variance(group_of(0, [0.1, 0.1 + 1e-12]))


def test_group_filter_drops_groups_without_variance():
    node = GroupFilter(ListNode(source_groups()), has_reward_variance)
    got = [g.prompt_index for g in Loader(node)]
    assert got == KEPT
    assert node.num_filtered == 5


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 5])
def test_group_filter_save_load_midway(stop_after):
    node = GroupFilter(ListNode(source_groups()), has_reward_variance)
    loader = Loader(node)
    it = iter(loader)
    first = [next(it).prompt_index for _ in range(stop_after)]
    state = loader.state_dict()
    filtered_at_save = node.num_filtered
    rest = [g.prompt_index for g in it]
    assert first + rest == KEPT

    node2 = GroupFilter(ListNode(source_groups()), has_reward_variance)
    loader2 = Loader(node2)
    loader2.load_state_dict(state)
    resumed = [g.prompt_index for g in loader2]
    if stop_after < len(KEPT):
        assert resumed == rest
        assert node2.num_filtered == 5
    else:  # saved at the very end: the loader restarts the epoch
        assert resumed == KEPT
    # the filtered count itself is part of the state
    assert state["root"][GroupFilter.NUM_FILTERED_KEY] == filtered_at_save
    node3 = GroupFilter(ListNode(source_groups()), has_reward_variance)
    node3.reset(state["root"])
    assert node3.num_filtered == filtered_at_save


def test_group_filter_node_state_roundtrip_direct():
    node = GroupFilter(ListNode(source_groups()), has_reward_variance)
    node.reset()
    assert next(node).prompt_index == 1
    assert next(node).prompt_index == 3
    state = node.state_dict()
    assert state == {"source": {"i": 4}, "num_filtered": 2}
    other = GroupFilter(ListNode(source_groups()), has_reward_variance)
    other.reset(state)
    assert other.num_filtered == 2
    assert [g.prompt_index for g in other] == [4, 7, 9]
    assert other.num_filtered == 5
    other.reset(None)
    assert other.num_filtered == 0
    assert [g.prompt_index for g in other] == KEPT


# ----------------------------------------------------------------------------------------------------------------------
# config


def test_loader_config_validation():
    with pytest.raises(ValueError, match="max_staleness"):
        LoaderConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="capacity"):
        LoaderConfig(capacity=0)
    with pytest.raises(ValueError):
        LoaderConfig(group_size=0)
    with pytest.raises(ValueError):
        LoaderConfig(batch_size=0)
    LoaderConfig(max_staleness=0)
    LoaderConfig(max_staleness=None)


def test_transport_config_validation():
    with pytest.raises(ValueError, match="bind"):
        TransportConfig(bind="foo://x")
    with pytest.raises(ValueError, match="peer_timeout_s"):
        TransportConfig(peer_timeout_s=1.0, heartbeat_s=1.0)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        TransportConfig(peer_timeout_s=0.5, heartbeat_s=1.0)
    with pytest.raises(ValueError):
        TransportConfig(curve_secret_key="x")
    TransportConfig(bind="ipc:///tmp/x", peer_timeout_s=1.01, heartbeat_s=1.0)
    TransportConfig(bind="inproc://x")


def test_other_config_validation():
    with pytest.raises(ValueError):
        WorkerConfig(slots=0)
    with pytest.raises(ValueError):
        FakeEngineConfig(min_new_tokens=5, max_new_tokens=4)


def test_from_dict_builds_nested_dataclasses():
    cfg = from_dict(
        LoaderConfig,
        {
            "group_size": 8,
            "max_staleness": 0,
            "capacity": 16,
            "transport": {"bind": "ipc:///tmp/pool", "heartbeat_s": 0.5, "peer_timeout_s": 3.0},
            "worker": {"slots": 2, "engine": {"max_new_tokens": 64, "seed": 7}},
        },
    )
    assert isinstance(cfg, LoaderConfig)
    assert cfg.group_size == 8 and cfg.max_staleness == 0 and cfg.capacity == 16
    assert isinstance(cfg.transport, TransportConfig)
    assert cfg.transport.bind == "ipc:///tmp/pool" and cfg.transport.peer_timeout_s == 3.0
    assert isinstance(cfg.worker, WorkerConfig) and cfg.worker.slots == 2
    assert isinstance(cfg.worker.engine, EngineConfig)
    assert cfg.worker.engine.max_new_tokens == 64 and cfg.worker.engine.seed == 7
    assert cfg.worker.engine.min_new_tokens == FakeEngineConfig().min_new_tokens
    # to_dict/from_dict round trip
    assert from_dict(LoaderConfig, to_dict(cfg)) == cfg


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="capacty"):
        from_dict(LoaderConfig, {"capacty": 3})
    with pytest.raises(ValueError, match="bnd"):
        from_dict(LoaderConfig, {"transport": {"bnd": "tcp://127.0.0.1:0"}})
    with pytest.raises(ValueError, match="max_tokens"):
        from_dict(LoaderConfig, {"worker": {"engine": {"max_tokens": 3}}})


def test_from_dict_nested_validation_applies():
    with pytest.raises(ValueError, match="bind"):
        from_dict(LoaderConfig, {"transport": {"bind": "foo://x"}})


def test_from_dict_types_scalars_by_field():
    """YAML 1.1 reads ``1e-4`` (no dot) as a string: a float field takes it, and ints, as floats; a scalar of
    the wrong kind is refused with its dotted key instead of failing later inside the trainer."""
    cfg = from_dict(LoaderConfig, {"transport": {"heartbeat_s": "5e-1", "peer_timeout_s": 3}})
    assert cfg.transport.heartbeat_s == 0.5 and isinstance(cfg.transport.peer_timeout_s, float)
    assert from_dict(LoaderConfig, {"max_staleness": None}).max_staleness is None
    with pytest.raises(ValueError, match=r"worker\.slots must be int, got 'two'"):
        from_dict(LoaderConfig, {"worker": {"slots": "two"}})
    with pytest.raises(ValueError, match=r"capacity must be int, got 2\.5"):
        from_dict(LoaderConfig, {"capacity": 2.5})
    with pytest.raises(ValueError, match=r"transport\.heartbeat_s must be float, got 'fast'"):
        from_dict(LoaderConfig, {"transport": {"heartbeat_s": "fast"}})
    with pytest.raises(ValueError, match=r"worker\.engine\.ignore_eos must be bool"):
        from_dict(LoaderConfig, {"worker": {"engine": {"type": "hf", "ignore_eos": "yes please"}}})
