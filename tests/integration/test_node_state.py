"""torchdata contract: the rollout pool node (and the graph above it) passes the save/load harness
with a real worker process in deterministic single-worker mode (one worker, one credit)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from datapipes.filters import GroupFilter
from tests.utils import run_test_save_load_state

pytestmark = pytest.mark.integration


def _key(batch) -> tuple:
    return tuple(batch["group_ids"]), tuple(tuple(row.tolist()) for row in batch["input_ids"]), float(batch["rewards"].sum())


def _deterministic_loader(**overrides) -> RolloutLoader:
    config = LoaderConfig(
        group_size=2,
        batch_size=3,
        capacity=4,
        num_workers=1,
        max_staleness=None,
        wait_timeout_s=60,
        poll_timeout_s=0.2,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=5),
        worker=WorkerConfig(slots=1, max_batch=1, engine=FakeEngineConfig(max_new_tokens=12)),
    )
    prompts = [{"prompt_ids": [i + 1, i + 2]} for i in range(20)]
    return RolloutLoader(prompts, config, **overrides)


@pytest.mark.parametrize("midpoint", [0, 3, 6])
def test_rollout_loader_graph_save_load(midpoint):
    loader = _deterministic_loader()
    try:
        run_test_save_load_state(loader.root, midpoint, key=_key)  # Batcher -> collate over the pool node
    finally:
        loader.close()


def test_group_filter_over_pool_node_save_load():
    loader = _deterministic_loader()
    try:
        node = GroupFilter(loader.pool_node, lambda g: g.prompt_index % 3 != 0)
        run_test_save_load_state(node, 4, key=lambda g: (g.group_id, [r.response_ids.tolist() for r in g.rollouts]))
        assert node.num_filtered > 0
    finally:
        loader.close()


def test_state_dict_survives_torch_save_and_new_loader(tmp_path):
    first = _deterministic_loader()
    try:
        it = iter(first)
        seen = [g for _ in range(2) for g in next(it)["group_ids"]]
        torch.save(first.state_dict(), tmp_path / "loader.pt")
        expected_rest = [g for batch in it for g in batch["group_ids"]]
    finally:
        first.close()
    second = _deterministic_loader()
    try:
        second.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
        rest = [g for batch in second for g in batch["group_ids"]]
    finally:
        second.close()
    assert rest == expected_rest
    assert sorted(seen + rest) == sorted(f"e0-p{i}" for i in range(20))


def test_one_ranks_state_at_another_number_of_ranks_is_refused_naming_the_elastic_resume():
    a = _deterministic_loader()
    try:
        state = a.state_dict()
    finally:
        a.close()
    b = _deterministic_loader(rank=1, world_size=2, num_workers=0)
    try:  # refused where the mistake is made (load_state_dict applies the state at once), naming the elastic resume
        with pytest.raises(ValueError, match=r"rank 0's of a run at 1 trainer ranks, but this ledger is rank 1 of 2: .*"
                                             r"give every rank the states of all 1 ranks"):
            b.load_state_dict(state)
    finally:
        b.close()


def test_an_iter_that_yields_nothing_does_not_advance_the_epoch():
    """Lightning calls iter() on a train loader to check it; that used to start epoch 0 and abandon it, so
    training began at epoch 1. Only an iter() after something was yielded starts the next epoch."""
    loader = _deterministic_loader()
    try:
        iter(loader)
        iter(loader)
        first = next(iter(loader))
        assert all(g.startswith("e0-") for g in first["group_ids"])
        assert loader.stats()["pool"].get("abandoned_uncommitted", 0) == 0
        second = next(iter(loader))  # something was yielded: a new iter() starts epoch 1, as a DataLoader would
        assert all(g.startswith("e1-") for g in second["group_ids"])
    finally:
        loader.close()


def test_load_state_dict_applies_the_state_at_once():
    """The version a user publishes right after load_state_dict is the resumed one, not 0: the state is applied
    when it is loaded, and the next iter() continues from it without fetching anything first."""
    first = _deterministic_loader()
    try:
        it = iter(first)
        next(it)
        first.set_policy_version(3)
        state = first.state_dict()
        yielded = first.stats()["pool"]["groups_yielded"]
    finally:
        first.close()
    second = _deterministic_loader()
    try:
        second.load_state_dict(state)
        assert second.policy_version == 3, "published before the first iter(), weights would carry version 0"
        assert second.stats()["epoch"] == 0 and second.stats()["consumed"] == yielded
        rest = [g for batch in second for g in batch["group_ids"]]
        assert len(rest) == 20 - yielded and all(g.startswith("e0-") for g in rest)
    finally:
        second.close()


def test_a_closed_loader_raises_at_once_and_never_restarts_a_worker():
    loader = _deterministic_loader()
    it = iter(loader)
    next(it)
    time.sleep(0.5)  # the worker fills the pool: a batch is buffered when the loader closes
    buffered = loader.stats()["pool"]["groups_received"] > loader.stats()["pool"]["groups_yielded"]
    pids = [p for p in loader.launcher.pids if p is not None]
    loader.close()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)  # a buffered batch must not come out of a closed loader, and an empty one must not block
    assert time.monotonic() - started < 1.0 and buffered
    for call in (lambda: iter(loader), lambda: loader.set_policy_version(1), lambda: loader.commit()):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    loader._health_check()  # what a next() would run: a closed launcher restarts nothing
    assert loader.launcher.restarts == [0] and loader.launcher.alive() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert loader.state_dict()["root"], "a closed loader's state can still be saved"
