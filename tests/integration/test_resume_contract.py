"""The resume contract as a model-based test: a hypothesis state machine drives real ``RolloutLoader``s (one per
trainer rank, fake-engine workers, real sockets) through training steps, checkpoints, epoch ends, closes and
resumes, rollbacks to older checkpoints included, and checks the guarantees after every step.

The consumer is the loop a user writes: it keeps ``prefetch`` batches fetched ahead of the one it trains (0: a
plain ``for`` loop; 1: Lightning), trains the oldest, then calls ``set_policy_version`` on every rank. At an epoch
end it trains what it holds before it starts the next epoch with a new ``iter()``. A checkpoint is every rank's
``state_dict()`` plus the trainer's version; a resume closes every loader, builds new ones and loads one of the
saved checkpoints (not always the newest: a rollback), and the model forgets what was trained after it. A resume may
be at the other number of ranks (1 <-> 2): every new loader is given the list of all saved ranks' states, and what is
left of the epoch is re-dealt.

Invariants (the guarantees, DESIGN section 4):
* along the surviving timeline each group of each epoch is trained at most once, and an epoch the consumer has
  left behind was trained exactly once (every prompt of every rank's shard);
* every trained rollout has ``0 <= trainer version - policy_version <= max_staleness`` (none newer than the trainer);
* a saved state says what was trained: its policy version is the trainer's, its epoch the consumer's (or the
  next one, with nothing consumed, once the consumer's epoch is all trained), and its consumed count the groups of
  the rank's shard of that epoch that were trained (by it, or before a resize by any rank);
* nothing hangs: every wait is bounded (``wait_timeout_s``), so a stuck pipeline fails the test.

The workers are the real worker loop (``workers.worker.run_worker``) on the fake engine, in threads of this
process instead of child processes, so a resume costs milliseconds and hypothesis can try many sequences; they
speak ZeroMQ over loopback to the pools exactly as worker processes do. ``make test`` runs a short profile; the
``extended`` one runs many more sequences.
"""

from __future__ import annotations

import collections
import threading
import time

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig
from asyncrl.pool.timeline import new_incarnation
from workers.worker import run_worker

pytestmark = pytest.mark.integration

PROMPTS = 12
GROUP_SIZE = 2
MAX_STALENESS = 1
TRANSPORT = TransportConfig(heartbeat_s=0.2, peer_timeout_s=5.0, handshake_timeout_s=10.0)


class ResumeContract(RuleBasedStateMachine):
    """One run: ``ranks`` loaders, ``workers`` worker threads serving every rank, a consumer model."""

    def __init__(self):
        super().__init__()
        self.loaders: list[RolloutLoader] = []
        self.threads: list[threading.Thread] = []
        self.generation = 0
        self.version = 0
        self.trained: dict[int, dict[int, int]] = collections.defaultdict(dict)  # epoch -> {prompt: rank}
        self.rank_epoch: list[int] = []  # per rank: the epoch of the newest batch fetched (or resumed at)
        self.shards: dict[tuple[int, int], list[int]] = {}  # (epoch, rank) -> the rank's shard, as its ledger has it
        self.checkpoints: list[dict] = []

    # -- the run -------------------------------------------------------------------------------
    @initialize(prefetch=st.sampled_from([0, 1]), ordered=st.booleans(), workers=st.sampled_from([1, 2]),
                ranks=st.sampled_from([1, 2]), batch_size=st.sampled_from([2, 3]))
    def start(self, prefetch: int, ordered: bool, workers: int, ranks: int, batch_size: int) -> None:
        self.prefetch, self.num_workers, self.ranks = prefetch, workers, ranks
        self.rank_epoch = [0] * ranks
        self.config = LoaderConfig(
            group_size=GROUP_SIZE, batch_size=batch_size, capacity=8, max_staleness=MAX_STALENESS, prefetch=prefetch,
            ordered=ordered, num_workers=0, wait_timeout_s=20, poll_timeout_s=0.1, lease_timeout_s=30,
            transport=TRANSPORT,
        )
        self._open(state=None)

    def _open(self, state: dict | None) -> None:
        self.generation += 1
        incarnation = new_incarnation()  # one per trainer start or resume, shared by its ranks
        self.loaders = [RolloutLoader(self.prompts, self.config, rank=r, world_size=self.ranks, incarnation=incarnation)
                        for r in range(self.ranks)]
        if state is not None:
            for r, loader in enumerate(self.loaders):  # at another number of ranks: the list of every rank's state
                loader.load_state_dict(state["ranks"][r] if len(state["ranks"]) == self.ranks else state["ranks"])
        endpoints = [loader.endpoint for loader in self.loaders]
        worker = WorkerConfig(slots=2, max_batch=2, engine=FakeEngineConfig(max_new_tokens=4))
        self.threads = [threading.Thread(target=run_worker, args=(endpoints, worker, TRANSPORT), daemon=True,
                                         kwargs={"worker_id": f"g{self.generation}w{i}"})
                        for i in range(self.num_workers)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 30  # every worker greeted every pool: a close from now on reaches them all
        while not all(len(loader.stats()["transport"]["workers"]) == self.num_workers for loader in self.loaders):
            assert time.monotonic() < deadline, "the worker threads did not join their pools"
            time.sleep(0.01)
        self.iters = [iter(loader) for loader in self.loaders]
        self._record_shards()
        self.held: list[collections.deque] = [collections.deque() for _ in self.loaders]  # fetched, not trained
        self.exhausted = [False] * self.ranks

    def _close(self) -> None:
        for loader in self.loaders:
            loader.close()  # SHUTDOWN: the worker threads return
        for t in self.threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a worker did not leave after its pools shut down"

    def teardown(self) -> None:
        if self.loaders:
            self._close()

    @property
    def prompts(self) -> list[dict]:
        return [{"prompt_ids": [i + 1, i + 2]} for i in range(PROMPTS)]

    # -- the consumer --------------------------------------------------------------------------
    def _fetch(self, r: int) -> None:
        while len(self.held[r]) < self.prefetch + 1 and not self.exhausted[r]:
            try:
                batch = next(self.iters[r])
            except StopIteration:
                if self.held[r]:
                    self.exhausted[r] = True  # train what it holds first (Lightning at an epoch end)
                    return
                self.iters[r] = iter(self.loaders[r])  # the next epoch
                continue
            self.held[r].append(batch)
            self.rank_epoch[r] = _epoch_of(batch)
            self._record_shards()

    def _record_shards(self) -> None:
        for r, loader in enumerate(self.loaders):
            self.shards[(loader.pool.ledger.epoch, r)] = list(loader.pool.ledger.order)

    def _train_one(self, r: int) -> None:
        self._fetch(r)
        batch = self.held[r].popleft()
        if not self.held[r]:
            self.exhausted[r] = False
        for gid in batch["group_ids"]:
            epoch, prompt = _parse(gid)
            assert prompt not in self.trained[epoch], f"{gid} trained twice (rank {r}, generation {self.generation})"
            self.trained[epoch][prompt] = r
        versions = batch["policy_versions"].tolist()
        assert max(versions) <= self.version, f"a rollout newer than the trainer: {versions} at {self.version}"
        assert self.version - min(versions) <= MAX_STALENESS, f"staleness over the bound: {versions} at {self.version}"

    @rule(steps=st.integers(1, 3), commit=st.booleans(), repeat=st.booleans())
    def train(self, steps: int, commit: bool = False, repeat: bool = False) -> None:
        """``steps`` updates; then, as loops may, ``commit()`` (commits nothing not trained: the held batches stay)
        and ``set_policy_version`` again with the same version (a repeated call trains nothing)."""
        for _ in range(steps):
            for r in range(self.ranks):
                self._train_one(r)
            self.version += 1
            for loader in self.loaders:
                loader.set_policy_version(self.version)
        for loader in self.loaders:
            if commit:
                loader.commit()
            if repeat:
                loader.set_policy_version(self.version)

    @rule(then_restart=st.booleans())
    def train_to_epoch_end(self, then_restart: bool) -> None:
        """Trains until every rank has trained the whole epoch it is in: a save now lands on an epoch end."""
        target = max(self.rank_epoch)
        while any(self._left_in_epoch(r, target) for r in range(self.ranks)):
            self.train(1)
        if then_restart:
            self.checkpoint_and_restart()

    def _left_in_epoch(self, r: int, epoch: int) -> bool:
        return self.rank_epoch[r] <= epoch and self._trained_by(r, epoch) < self._shard(r, epoch)

    def _trained_by(self, r: int, epoch: int) -> int:
        """The prompts of rank ``r``'s shard of ``epoch`` trained so far (by it, or by any rank before a resize)."""
        return sum(1 for prompt in self.shards[(epoch, r)] if prompt in self.trained[epoch])

    def _shard(self, r: int, epoch: int) -> int:
        return len(self.shards[(epoch, r)])

    # -- checkpoints ---------------------------------------------------------------------------
    @rule()
    def save(self) -> None:
        states = [loader.state_dict() for loader in self.loaders]
        for r, state in enumerate(states):
            self._check_saved(r, _pool_state(state))
        self.checkpoints.append({
            "ranks": states, "version": self.version, "rank_epoch": list(self.rank_epoch),
            "trained": {e: dict(c) for e, c in self.trained.items()}, "shards": dict(self.shards),
        })

    def _check_saved(self, r: int, pool: dict) -> None:
        ledger = pool["ledger"]
        consumed = ledger["watermark"] + len(ledger["consumed_above"])
        epoch = self.rank_epoch[r]
        trained, shard = self._trained_by(r, epoch), self._shard(r, epoch)
        assert pool["policy_version"] == self.version, f"saved version {pool['policy_version']} != {self.version}"
        on_epoch = (ledger["epoch"], consumed) == (epoch, trained)
        next_epoch = (ledger["epoch"], consumed) == (epoch + 1, 0) and trained == shard
        assert on_epoch or next_epoch, (
            f"rank {r}: saved epoch {ledger['epoch']} with {consumed} consumed, but the consumer is in epoch {epoch} "
            f"with {trained} of {shard} trained (a state frozen at an older point?)")

    @rule()
    def checkpoint_and_restart(self) -> None:
        """A checkpoint, then the trainer dies and resumes from it (the common case)."""
        self.save()
        self._resume(len(self.checkpoints) - 1)

    @rule()
    def resize(self) -> None:
        """A checkpoint, then the trainer resumes from it at the other number of ranks (1 <-> 2): a node lost or
        gained."""
        self.save()
        self._resume(len(self.checkpoints) - 1, ranks=3 - self.ranks)

    @precondition(lambda self: len(self.checkpoints) > 1)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """The trainer resumes from an older checkpoint than its newest (a rolled-back run), at the number of ranks
        it has now (which may not be the one that saved it)."""
        self._resume(data.draw(st.integers(0, len(self.checkpoints) - 2), label="checkpoint"))

    def _resume(self, index: int, ranks: int | None = None) -> None:
        ckpt = self.checkpoints[index]
        del self.checkpoints[index + 1:]  # the timeline forks here: later checkpoints belong to a dead branch
        self._close()
        self.ranks = ranks or self.ranks
        self.version = ckpt["version"]
        self.rank_epoch = list(ckpt["rank_epoch"])
        self.trained = collections.defaultdict(dict, {e: dict(c) for e, c in ckpt["trained"].items()})
        self.shards = dict(ckpt["shards"])
        self._open(ckpt)
        if len(ckpt["ranks"]) != self.ranks:  # re-dealt: each rank is resumed at the epoch its new shard is of
            self.rank_epoch = [loader.pool.ledger.epoch for loader in self.loaders]

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def epochs_left_behind_were_trained_exactly_once(self) -> None:
        if not self.rank_epoch:
            return
        for epoch in range(min(self.rank_epoch)):
            missing = sorted(set(range(PROMPTS)) - set(self.trained[epoch]))
            assert not missing, f"epoch {epoch} left behind with prompts never trained: {missing}"


def _epoch_of(batch) -> int:
    return _parse(batch["group_ids"][0])[0]


def _parse(group_id: str) -> tuple[int, int]:
    epoch, prompt = group_id.split("-")
    return int(epoch[1:]), int(prompt[1:])


def _pool_state(loader_state: dict) -> dict:
    node = loader_state["root"]
    while "pool" not in node:
        node = next(v for v in node.values() if isinstance(v, dict))
    return node["pool"]


ResumeContract.TestCase.settings = settings(
    max_examples=25, stateful_step_count=10, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_resume_contract = ResumeContract.TestCase


@pytest.mark.extended
class TestResumeContractLong(ResumeContract.TestCase):
    settings = settings(max_examples=150, stateful_step_count=25, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
