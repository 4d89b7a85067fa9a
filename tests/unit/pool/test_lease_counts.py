"""The counts a grant pass reads instead of scanning every lease: leases per worker and prompts leased (the ledger
keeps them as leases come and go), and ``groups_in_flight`` from them, against a scan after every operation of a
random sequence (lease, group, failure, expiry, worker lost, undelivered, skipped, reset, resume)."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.rollout import Rollout


def _rollout(epoch: int, prompt_index: int, sample: int, worker_id: str) -> Rollout:
    ids = torch.tensor([1, 2], dtype=torch.int32)
    return Rollout(epoch=epoch, prompt_index=prompt_index, sample_index=sample, worker_id=worker_id, policy_version=0,
                   prompt_ids=ids, response_ids=ids, logprobs=torch.tensor([-0.5, -0.5]))


def _check(pool: RolloutPool) -> None:
    ledger = pool.ledger
    scan = collections.Counter(lease.worker_id for lease in ledger.leases.values())
    assert ledger.held_per_worker() == scan
    assert all(ledger.held(w) == n for w, n in scan.items())
    prompts = {lease.prompt_index for lease in ledger.leases.values()}
    assert ledger.num_leased_prompts == len(prompts)
    assert pool.groups_in_flight == len(pool._ready) + len(set(pool._partial) | prompts)


@pytest.mark.parametrize("seed", range(6))
def test_lease_counts_match_a_scan_after_every_operation(seed):
    rng = random.Random(seed)
    pool = RolloutPool(PromptLedger(60, lease_timeout_s=5.0), group_size=2, capacity=40, max_prompt_failures=2,
                       on_poisoned_prompt="skip", failure_backoff_s=0.0)
    pool.start_epoch(0)
    workers = [f"w{i}" for i in range(4)]
    now = 0.0
    for _ in range(400):
        now += rng.random()
        op = rng.random()
        leases = list(pool.ledger.leases.values())
        if op < 0.35:
            pool.grant(rng.choice(workers), rng.randint(1, 4), now)
        elif op < 0.55 and leases:  # a group (or half of one) arrives for a lease, maybe from another lease's worker
            lease = rng.choice(leases)
            samples = [0, 1] if rng.random() < 0.8 else [rng.randint(0, 1)]
            pool.add_rollouts([_rollout(lease.epoch, lease.prompt_index, s, lease.worker_id) for s in samples],
                              lease_id=lease.lease_id)
            pool.release_held(lease.lease_id, lease.worker_id, "rejected")
        elif op < 0.65 and leases:
            lease = rng.choice(leases)
            pool.lease_failed(lease.lease_id, lease.worker_id, "boom", now)
        elif op < 0.72:
            pool.expire(now)
        elif op < 0.78:
            pool.release_worker(rng.choice(workers))
        elif op < 0.84 and leases:
            pool.undeliver(rng.sample(leases, k=min(2, len(leases))))
        elif op < 0.92:
            try:
                while (group := pool.take(timeout=0)) is not None:
                    pool.commit(group.epoch, [group.prompt_index])
            except StopIteration:  # the epoch is over
                pool.start_epoch(pool.ledger.epoch + 1)
        elif op < 0.96:
            pool.load_state_dict(pool.state_dict())  # a resume: every lease cancelled
        else:
            pool.start_epoch(pool.ledger.epoch + 1)
        _check(pool)
