"""The streaming worker loop (workers/streaming.py) in-process, with the fake engine's continuous batching and small
fakes of the channel ends: groups leave as they finish, updates applied in flight split the spans, abort mode
regenerates each aborted group once, failures stay per lease, a lease of a version the engine lacks waits
without holding up the others; the fake engine's stream equals its static batches; occupancy."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import pytest

from asyncrl.config import FakeEngineConfig, HFEngineConfig, VllmEngineConfig, WorkerConfig
from asyncrl.rewards import RewardSet
from asyncrl.rewards.legacy import fake_reward
from asyncrl.transport import ReceivedLease
from workers.engines.base import GenerationRequest
from workers.engines.fake import FakeEngine
from workers.worker import RolloutWorker

SPT = 0.002  # seconds per token of the fake engine


class StreamSender:
    """Hands out its leases as credits free up; done once every lease was answered (group or FAILED)."""

    def __init__(self, leases):
        self.queue = collections.deque(leases)
        self.answers = len(leases)
        self.groups, self.failed, self.sent_at, self.status = [], [], [], {}
        self.culprits = []
        self.taken: list[int] = []

    @property
    def done(self):
        return len(self.groups) + len(self.failed) >= self.answers

    def take_leases(self, max_leases, timeout):
        out = [self.queue.popleft() for _ in range(min(max_leases, len(self.queue)))]
        self.taken += [x.lease_id for x in out]
        return out

    def send_group(self, lease, group):
        self.groups.append((lease.lease_id, group))
        self.sent_at.append(time.perf_counter())

    def send_failed(self, lease, error, culprit=None):
        self.failed.append((lease.lease_id, error))
        self.culprits.append(culprit)


class StagedWeights:
    """A weight receiver that stages ``update`` once ``ready()`` says so (checked at every poll)."""

    def __init__(self, update, ready):
        self.update, self.ready, self.committed = update, ready, []

    def poll(self):
        if self.update is not None and self.ready():
            update, self.update = self.update, None
            return update
        return None

    def wait(self, version, timeout, incarnation=None):
        return self.poll()

    def commit(self, version):
        self.committed.append(version)

    def stats(self):
        return {"failures": 0}


def _lease(i: int, *, n: int = 2, version: int = 0, prompt=None, incarnation: str = "") -> ReceivedLease:
    return ReceivedLease(conn=0, lease_id=i + 1, epoch=0, prompt_index=i, group_size=n,
                         prompt=prompt if prompt is not None else {"prompt_ids": [i + 1, 2]}, policy_version=version,
                         incarnation=incarnation)


def _engine(**kw) -> FakeEngine:
    base = {"seconds_per_token": SPT, "min_new_tokens": 2, "max_new_tokens": 120, "length_tail": 1.0,
            "length_median": 10}
    return FakeEngine(FakeEngineConfig(**{**base, **kw}))


def _worker(engine, sender, *, slots=4, weights=None, mode="keep", reward=fake_reward, catch_up_s=10.0):
    return RolloutWorker("w0", engine, reward, sender, max_batch=slots, slots=slots, streaming=True,
                         weights=weights, weights_in_flight=mode, catch_up_s=catch_up_s)


def _longest(engine: FakeEngine, lease: ReceivedLease) -> int:
    req = GenerationRequest(epoch=lease.epoch, prompt_index=lease.prompt_index, prompt=lease.prompt,
                            n=lease.group_size)
    return max(engine._length(engine._rng(req, s, 0)) for s in range(req.n))


def _update(version: int, incarnation: str = "") -> SimpleNamespace:
    return SimpleNamespace(version=version, incarnation=incarnation, mode="full", tensors={})


def test_config_streaming_fields_are_checked():
    assert WorkerConfig().streaming is False and WorkerConfig().weights_in_flight == "keep"
    with pytest.raises(ValueError, match="weights_in_flight"):
        WorkerConfig(streaming=True, weights_in_flight="drop")  # type: ignore[arg-type]
    assert WorkerConfig(streaming=True, weights_in_flight="keep_cache", engine=HFEngineConfig())
    with pytest.raises(ValueError, match="keep_cache.*vLLM's keep recomputes"):  # vLLM recomputes: no such mode
        WorkerConfig(streaming=True, weights_in_flight="keep_cache", engine=VllmEngineConfig())
    with pytest.raises(ValueError, match="replaces worker.interrupt_every_tokens"):
        WorkerConfig(streaming=True, interrupt_every_tokens=8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        FakeEngineConfig(max_num_seqs=0)


def test_a_streaming_worker_refuses_an_engine_that_does_not_stream():
    engine = _engine()
    engine.streaming = False  # like an engine without submit/poll
    with pytest.raises(ValueError, match="needs an engine that streams"):
        _worker(engine, StreamSender([]))


def test_the_stream_yields_exactly_the_static_rollouts_and_measures_occupancy():
    leases = [_lease(i, n=3) for i in range(5)]
    requests = [GenerationRequest(epoch=0, prompt_index=x.prompt_index, prompt=x.prompt, n=3) for x in leases]
    static_engine = _engine(max_num_seqs=15)
    static = static_engine.generate(requests)
    engine = _engine(max_num_seqs=4)  # 15 sequences through 4 slots: most wait in the queue
    for key, req in enumerate(requests):
        engine.submit(key, req)
    got = {}
    while engine.in_flight():
        for f in engine.poll(1.0):
            got[f.key] = f.completions
    for key, group in enumerate(static):
        assert [c.response_ids.tolist() for c in group] == [c.response_ids.tolist() for c in got[key]]
        assert [c.logprobs.tolist() for c in group] == [c.logprobs.tolist() for c in got[key]]
        assert all(c.version_spans == [] and c.policy_version == 0 for c in got[key])
    tokens = sum(c.response_ids.numel() for group in static for c in group)
    for e in (static_engine, engine):
        occ = e.occupancy()
        assert occ["busy_seq_s"] == pytest.approx(tokens * SPT, rel=1e-6)  # every sequence: its own tokens' time
        assert 0 < occ["busy_seq_s"] <= occ["capacity_seq_s"]


def test_a_short_group_is_sent_before_a_long_one_of_the_same_batch_finishes():
    probe = _engine()
    leases = [_lease(i, n=2) for i in range(12)]
    by_length = sorted(leases, key=lambda x: _longest(probe, x))
    short, long = by_length[0], by_length[-1]
    assert _longest(probe, long) >= _longest(probe, short) + 20  # well apart: 40 ms of decoding at least
    sender = StreamSender([short, long])
    engine = _engine()
    w = _worker(engine, sender, slots=2)  # both leases in one engine batch
    w.run()
    assert [lid for lid, _ in sender.groups] == [short.lease_id, long.lease_id]
    assert sender.taken == [short.lease_id, long.lease_id]
    assert w.groups_sent == 2 and w.lease_failures == 0
    assert w._loop.in_flight == {}


def test_a_freed_slot_is_refilled_at_once_and_every_lease_is_answered_once():
    leases = [_lease(i, n=2) for i in range(16)]
    sender = StreamSender(leases)
    w = _worker(_engine(max_num_seqs=6), sender, slots=3)
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [x.lease_id for x in leases]
    assert w.groups_sent == 16 and not sender.failed
    status = sender.status
    assert 0 < status["busy_seq_s"] <= status["capacity_seq_s"] and status["groups_resubmitted"] == 0
    assert len(status) <= 24  # the pool keeps at most asyncrl.pool.admission.MAX_STATUS_KEYS
    # 16 leases through 3 slots, handed out as fast as slots free: the slots are held nearly all the time
    assert 0.5 * 3 * status["uptime_s"] < status["leases_held_s"] <= 3 * status["uptime_s"]


def test_an_update_applied_in_flight_splits_the_spans_at_the_update():
    leases = [_lease(i, n=2) for i in range(6)]
    sender = StreamSender(leases)
    engine = _engine(min_new_tokens=30, max_new_tokens=60, weight_load_s=0.01)
    weights = StagedWeights(_update(1), ready=lambda: engine.in_flight() > 0 and engine._running
                            and all(s.done + (time.perf_counter() - s.mark) / SPT > 3 for s in engine._running))
    w = _worker(engine, sender, slots=6, weights=weights)
    w.run()
    assert weights.committed == [1] and w.inflight_updates == 1 and len(w.inflight_pauses) == 1
    assert w.inflight_pauses[0] >= 0.01  # the engine's pause (weight_load_s) while requests were in flight
    rollouts = [r for _, g in sender.groups for r in g.rollouts]
    assert len(rollouts) == 12
    split = [r for r in rollouts if r.version_spans]
    assert split, "no rollout spans the update"
    for r in split:
        (v0, a0, b0), (v1, a1, b1) = r.version_spans
        assert (v0, v1) == (0, 1) and a0 == 0 and b0 == a1 and b1 == r.response_ids.numel() and 0 < b0
        assert r.policy_version == 0  # its oldest token's version: staleness stays conservative
    assert sender.status["inflight_updates"] == 1 and sender.status["inflight_pause_p99_s"] >= 0.01


def test_abort_mode_regenerates_each_aborted_group_once_and_loses_nothing():
    leases = [_lease(i, n=2) for i in range(8)]
    sender = StreamSender(leases)
    engine = _engine(min_new_tokens=20, max_new_tokens=40)
    aborted = []
    weights = StagedWeights(_update(1), ready=lambda: len(engine._running) >= 4)

    poll = engine.poll

    def counting_poll(timeout):
        out = poll(timeout)
        aborted.extend(f.key for f in out if f.aborted)
        return out

    engine.poll = counting_poll
    w = _worker(engine, sender, slots=4, weights=weights, mode="abort")
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [x.lease_id for x in leases]  # each lease once
    assert len(aborted) == 4 and w.groups_resubmitted == 4  # the 4 in flight at the update, each submitted once
    for lease_id, group in sender.groups:
        for r in group.rollouts:  # nothing of the aborted attempt was kept
            assert r.version_spans == []
    resubmitted = {lid for lid, g in sender.groups if g.rollouts[0].policy_version == 1}
    assert len(resubmitted) >= 4


def test_failures_stay_per_lease():
    def reward(prompts, completions):
        if prompts[0].get("bad_reward"):
            raise ValueError("reward function broke")
        return fake_reward(prompts, completions)

    leases = [_lease(0), _lease(1, prompt={"foo": 1}), _lease(2, prompt={"prompt_ids": [3], "bad_reward": True}),
              _lease(3)]
    sender = StreamSender(leases)
    w = _worker(_engine(), sender, slots=4, reward=RewardSet([reward]))
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [1, 4]
    failed = dict(sender.failed)
    assert sorted(failed) == [2, 3] and "an engine needs a prompt with" in failed[2]
    assert "reward function broke" in failed[3]
    assert w.lease_failures == 2


def test_a_lease_of_a_version_the_engine_lacks_waits_without_holding_up_the_others():
    engine = _engine()
    engine.follows_pool_version = False  # it has received weights: it follows the broadcaster
    early = [_lease(i, n=2) for i in range(3)]
    late = _lease(3, n=2, version=1)
    sender = StreamSender([*early, late])
    weights = StagedWeights(_update(1), ready=lambda: len(sender.groups) >= 3)
    w = _worker(engine, sender, slots=4, weights=weights)
    w.run()
    order = [lid for lid, _ in sender.groups]
    assert order[-1] == late.lease_id and sorted(order[:3]) == [1, 2, 3]
    assert all(r.policy_version == 0 for _, g in sender.groups[:3] for r in g.rollouts)
    assert all(r.policy_version == 1 for r in sender.groups[-1][1].rollouts)  # generated after catching up


def test_groups_of_an_old_incarnation_are_not_sent_but_generated_again():
    engine = _engine(min_new_tokens=20, max_new_tokens=40)
    engine.follows_pool_version = False
    engine.incarnation = "old"
    leases = [_lease(i, n=2, incarnation="old") for i in range(3)]
    sender = StreamSender(leases)
    weights = StagedWeights(_update(0, incarnation="new"), ready=lambda: len(engine._running) >= 6)
    w = _worker(engine, sender, slots=3, weights=weights, catch_up_s=0.0)
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [1, 2, 3] and w.groups_resubmitted == 3
    assert all(r.incarnation == "new" and not r.version_spans for _, g in sender.groups for r in g.rollouts)


def test_a_request_the_engine_loses_is_submitted_again_not_waited_for():
    class Losing(FakeEngine):
        lost = 0

        def submit(self, key, request):
            if not self.lost:  # swallowed: never in flight, never returned by poll
                self.lost += 1
                return
            super().submit(key, request)

    engine = Losing(FakeEngineConfig(seconds_per_token=SPT, min_new_tokens=2, max_new_tokens=20))
    sender = StreamSender([_lease(0), _lease(1)])
    w = _worker(engine, sender, slots=2)
    w.run()
    assert sorted(lid for lid, _ in sender.groups) == [1, 2] and w.groups_resubmitted == 1
