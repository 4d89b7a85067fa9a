"""The update guard across real gloo ranks (DDP and FSDP2): every rank agrees and restores; a group of one rank
decides without a collective. (The single-process rules: tests/unit/train/test_guard.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config import GuardConfig
from asyncrl.train.guard import UpdateGuard
from tests.unit.train.test_guard import _assert_same, _loss, _model, _state

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


def _ranks(rank: int, world: int, init: str, parallels: list[str], out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for parallel in parallels:  # one process group for all: a spawn costs an interpreter start per rank
            out[parallel, rank] = _guarded_steps(rank, parallel)
    finally:
        dist.destroy_process_group()


def _guarded_steps(rank: int, parallel: str) -> tuple:
    model = _model()
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    guard = UpdateGuard(wrapped, opt, GuardConfig(max_update_ratio=0.5))
    verdicts = [guard.step(_loss(wrapped)).accepted]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    before = [local(p.detach()).clone() for p in wrapped.parameters()]
    # a NaN loss on rank 1 only, whose gradients stay finite (a constant term): rank 0's loss and gradients
    # are finite, yet it must reject too
    v = guard.step(_loss(wrapped) + (torch.tensor(float("nan")) if rank == 1 else 0.0))
    verdicts.append(v.accepted)
    same = all(torch.equal(local(p.detach()), b) for p, b in zip(wrapped.parameters(), before))
    # a step too large on every rank (lr 1e3): rejected and undone everywhere
    opt.param_groups[0]["lr"] = 1e3
    v2 = guard.step(_loss(wrapped))
    verdicts.append(v2.accepted)
    same2 = all(torch.equal(local(p.detach()), b) for p, b in zip(wrapped.parameters(), before))
    return verdicts, v.reason, same, same2, v2.update_ratio


PARALLELS = ["ddp", "fsdp2"]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    """``(parallel, rank) -> results`` of the guarded steps under each of :data:`PARALLELS`, from one spawn of 2
    gloo ranks."""
    with mp.Manager() as manager:
        out = manager.dict()
        store = tmp_path_factory.mktemp("guard-ranks") / "store"
        mp.spawn(_ranks, args=(2, f"file://{store}", PARALLELS, out), nprocs=2, join=True)
        return dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", PARALLELS)
def test_every_rank_agrees_and_restores(two_rank_results, parallel):
    results = {rank: two_rank_results[parallel, rank] for rank in (0, 1)}
    for rank in (0, 1):
        verdicts, reason, same, same2, _ = results[rank]
        assert verdicts == [True, False, False], (rank, results)
        assert "non-finite" in reason and same and same2
    assert "(on another rank)" in results[0][1]
    assert results[0][4] == results[1][4]  # the ratio is global: FSDP2 shards add up, DDP replicas agree


def test_a_group_of_one_rank_decides_without_a_collective(tmp_path, monkeypatch):
    """One trainer rank (torchrun --nproc-per-node 1): the sums over the group are this rank's own, so the verdicts
    are the same and no all_reduce is waited on."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        def no_collective(*_, **__):
            raise AssertionError("all_reduce in a group of one")

        monkeypatch.setattr(dist, "all_reduce", no_collective)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = UpdateGuard(model, opt, GuardConfig(max_update_ratio=0.5))
        before = _state(model, opt)
        verdict = guard.step(_loss(model, scale=float("nan")))
        assert not verdict and "non-finite loss=nan" in verdict.reason and "another rank" not in verdict.reason
        _assert_same(before, _state(model, opt))
        verdict = guard.step(_loss(model))
        assert verdict and 0 < verdict.update_ratio <= 0.5
    finally:
        dist.destroy_process_group()
