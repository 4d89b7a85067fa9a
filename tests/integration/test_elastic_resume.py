"""An elastic resume with real loaders: states saved at M trainer ranks, loaded at M′ as the list of every rank's state.

Real ``RolloutLoader``s (one per rank, no process group: each is told its rank), the real worker loop on the fake
engine in threads of this process, ZeroMQ on loopback. What is checked:

* bit-exact where a run at M′ from scratch is: synchronous (``max_staleness=0``), ordered, a deterministic engine.
  After the same prompts are trained (a prefix of the epoch: 8 groups, a whole number of windows at M and M′), each
  rank of the resumed run yields, batch for batch, exactly the tensors a run at M′ from scratch yields from that
  point (at the same policy versions), to the end of the epoch and through the next one;
* groups buffered or delivered but not trained at the save are trained by their new owner from the saved tensors
  (they carry the saving run's worker ids), each prompt of the epoch trained once across the two parts.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.pool.timeline import new_incarnation
from workers.worker import run_worker

pytestmark = pytest.mark.integration

PROMPTS = 16
TRANSPORT = TransportConfig(heartbeat_s=0.2, peer_timeout_s=5.0, handshake_timeout_s=10.0)
EXACT = LoaderConfig(group_size=2, batch_size=2, capacity=8, max_staleness=0, ordered=True, num_workers=0,
                     wait_timeout_s=30, poll_timeout_s=0.1, transport=TRANSPORT)
TENSORS = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "rewards", "policy_versions")


class Run:
    """One trainer incarnation: ``ranks`` loaders and two worker threads serving all of them."""

    count = 0

    def __init__(self, ranks: int, config: LoaderConfig, states: list[dict] | None = None):
        Run.count += 1
        self.name = f"run{Run.count}"
        incarnation = new_incarnation()
        prompts = [{"prompt_ids": [i + 1, i + 2, i % 3 + 1]} for i in range(PROMPTS)]
        self.loaders = [RolloutLoader(prompts, config, rank=r, world_size=ranks, incarnation=incarnation)
                        for r in range(ranks)]
        if states is not None:
            for loader in self.loaders:
                loader.load_state_dict(states)  # every rank gets the list of every saved rank's state
        worker = WorkerConfig(slots=2, max_batch=2, engine=FakeEngineConfig(max_new_tokens=4))
        endpoints = [loader.endpoint for loader in self.loaders]
        self.threads = [threading.Thread(target=run_worker, args=(endpoints, worker, TRANSPORT), daemon=True,
                                         kwargs={"worker_id": f"{self.name}w{i}"}) for i in range(2)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 30  # every worker greeted every pool: a close from now on reaches them all
        while not all(len(loader.stats()["transport"]["workers"]) == len(self.threads) for loader in self.loaders):
            assert time.monotonic() < deadline, "the worker threads did not join their pools"
            time.sleep(0.01)
        self.iters = [iter(loader) for loader in self.loaders]
        self.version = self.loaders[0].policy_version

    def step(self, version: int | None = None) -> list[dict]:
        """One update on every rank: a batch each, then the new version (``version``, default one more)."""
        batches = [next(it) for it in self.iters]
        self.version = self.version + 1 if version is None else version
        for loader in self.loaders:
            loader.set_policy_version(self.version)
        return batches

    def rest_of_epoch(self) -> list[list[dict]]:
        """Steps until every rank's epoch is over; per step, each rank's batch (None once its shard is done)."""
        steps, done = [], [False] * len(self.loaders)
        while not all(done):
            row = []
            for r, it in enumerate(self.iters):
                batch = None
                if not done[r]:
                    try:
                        batch = next(it)
                    except StopIteration:
                        done[r] = True
                        self.iters[r] = iter(self.loaders[r])  # the next epoch
                row.append(batch)
            if any(b is not None for b in row):
                steps.append(row)
                self.version += 1
                for loader in self.loaders:
                    loader.set_policy_version(self.version)
        return steps

    def save(self) -> list[dict]:
        return [loader.state_dict() for loader in self.loaders]

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()
        for t in self.threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a worker did not leave after its pools shut down"


def _same(a: dict, b: dict, where: str) -> None:
    assert a["group_ids"] == b["group_ids"] and a["uids"] == b["uids"], where
    for key in TENSORS:
        assert torch.equal(a[key], b[key]), f"{where}: {key}"


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_a_synchronous_ordered_run_resumed_at_another_size_is_batch_for_batch_the_run_at_that_size(saved, resumed):
    # the saved run trains 8 groups (2 per rank and step), one version per step
    first = Run(saved, EXACT)
    try:
        for _ in range(4 // saved):
            first.step()
        states = first.save()
        version = first.version
    finally:
        first.close()
    assert version == 4 // saved
    # the same 8 groups trained at the new size from scratch, its versions following the saved run's
    scratch = Run(resumed, EXACT)
    try:
        steps = 4 // resumed
        for k in range(1, steps + 1):
            scratch.step(version=version * k // steps)
        expected = scratch.rest_of_epoch() + scratch.rest_of_epoch()  # this epoch's end and the whole next one
    finally:
        scratch.close()
    again = Run(resumed, EXACT, states)
    try:
        assert again.version == version
        got = again.rest_of_epoch() + again.rest_of_epoch()
        stats = [loader.stats() for loader in again.loaders]
    finally:
        again.close()
    assert len(got) == len(expected) == (PROMPTS - 8) // (2 * resumed) + PROMPTS // (2 * resumed)
    for step, (row, want) in enumerate(zip(got, expected)):
        for rank, (a, b) in enumerate(zip(row, want)):
            _same(a, b, f"step {step} after the resume, rank {rank}")
    assert all(s["pool"]["resharded"] >= 1 for s in stats)


def test_groups_not_trained_at_the_save_are_trained_from_the_saved_tensors_by_their_new_owner():
    """Saved at 2 ranks with a batch held by each (prefetch=1: delivered, not trained) and groups buffered behind it;
    resumed at 1, saved the same way, resumed at 2: every prompt of the epoch trained once over the three parts, and
    each group held or buffered at a save trained with the saving run's rollouts (its worker ids), not regenerated."""
    # unbounded staleness: no saved group may turn stale and be regenerated (counted) instead of moved
    config = LoaderConfig(group_size=2, batch_size=2, capacity=8, max_staleness=None, prefetch=1, num_workers=0,
                          wait_timeout_s=30, poll_timeout_s=0.1, transport=TRANSPORT)
    trained: collections.Counter[str] = collections.Counter()
    saved_by: dict[str, str] = {}  # group -> worker of the rollouts a save held for it
    states = None

    def train(batch: dict) -> None:
        for j, gid in enumerate(batch["group_ids"]):
            if not gid.startswith("e0-"):
                continue  # the next epoch, fetched ahead at the end
            trained[gid] += 1
            if gid in saved_by:
                assert batch["worker_ids"][j * config.group_size] == saved_by.pop(gid), f"{gid} was regenerated"

    for ranks, steps in [(2, 1), (1, 2), (2, None)]:
        run = Run(ranks, config, states)
        try:
            held = [next(it) for it in run.iters]  # the prefetching loop's batch, fetched ahead
            if steps is None:  # the last part trains the epoch to its end
                for b in held:
                    train(b)
                for row in run.rest_of_epoch():
                    for b in row:
                        if b is not None:
                            train(b)
                break
            for _ in range(steps):
                batches = [next(it) for it in run.iters]
                for b in held:
                    train(b)
                held = batches
                run.version += 1
                for loader in run.loaders:
                    loader.set_policy_version(run.version)
            deadline = time.monotonic() + 30
            while not all(loader.pool.state_dict()["ready"][len(held[0]["group_ids"]):] for loader in run.loaders):
                assert time.monotonic() < deadline, "no group buffered behind the held batch"
                time.sleep(0.02)
            states = run.save()
            untrained = {f"e0-p{g['prompt_index']}": g["rollouts"][0]["worker_id"]
                         for s in states for g in _pool(s)["ready"] if g["epoch"] == 0}
            assert saved_by.items() <= untrained.items()  # moved at the last resume, not trained yet: saved again
            saved_by = untrained
            assert {g for b in held for g in b["group_ids"]} <= set(saved_by)  # the held batches are saved, untrained
        finally:
            run.close()
    assert not saved_by, f"groups saved untrained but never trained: {sorted(saved_by)}"
    assert set(trained) == {f"e0-p{i}" for i in range(PROMPTS)}
    assert set(trained.values()) == {1}, [g for g, n in trained.items() if n > 1]


def _pool(loader_state: dict) -> dict:
    node = loader_state["root"]
    while "pool" not in node:
        node = next(v for v in node.values() if isinstance(v, dict))
    return node["pool"]
