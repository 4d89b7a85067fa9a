"""Tests for asyncrl.pool.buffer.RolloutPool: capacity, dedup, staleness, exactly-once and the state dict."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger, PromptState
from asyncrl.rollout import Group, Rollout

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def make_group(
    epoch: int,
    prompt_index: int,
    group_size: int,
    policy_version: int,
    *,
    worker_id: str = "w0",
    prompt_len: int = 5,
    response_len: int | None = None,
) -> Group:
    """A valid group; tensors deterministic in (epoch, prompt_index, sample_index, policy_version)."""
    rollouts = []
    for s in range(group_size):
        g = torch.Generator().manual_seed(epoch * 1_000_003 + prompt_index * 1009 + s * 31 + policy_version)
        n = response_len if response_len is not None else 3 + (prompt_index + s) % 5
        rollouts.append(
            Rollout(
                epoch=epoch,
                prompt_index=prompt_index,
                sample_index=s,
                worker_id=worker_id,
                policy_version=policy_version,
                prompt_ids=torch.randint(0, 1000, (prompt_len,), generator=g, dtype=torch.int32),
                response_ids=torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
                logprobs=-torch.rand(n, generator=g, dtype=torch.float32) * 3,
                reward=float(s % 2),
            )
        )
    group = Group(epoch=epoch, prompt_index=prompt_index, rollouts=rollouts)
    group.validate(group_size)
    for r in rollouts:
        r.validate()
    return group



def take(pool: RolloutPool, timeout: float) -> Group | None:
    """``pool.take`` as a plain training loop sees it: the update each group feeds is committed at once."""
    g = pool.take(timeout=timeout)
    if g is not None:
        pool.commit(g.epoch, [g.prompt_index])
    return g

def make_pool(
    num_prompts: int = 8,
    *,
    group_size: int = 2,
    capacity: int = 4,
    max_staleness: int | None = None,
    seed: int = 0,
    start: bool = True,
    **ledger_kw,
) -> RolloutPool:
    ledger = PromptLedger(num_prompts, seed=seed, **ledger_kw)
    pool = RolloutPool(ledger, group_size=group_size, capacity=capacity, max_staleness=max_staleness)
    if start:
        pool.start_epoch(0)
    return pool


def deliver(pool: RolloutPool, lease, policy_version: int | None = None) -> Group:
    pv = pool.policy_version if policy_version is None else policy_version
    group = make_group(lease.epoch, lease.prompt_index, pool.group_size, pv, worker_id=lease.worker_id)
    assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == pool.group_size
    return group


def assert_groups_equal(a: Group, b: Group) -> None:
    assert (a.epoch, a.prompt_index, a.group_id) == (b.epoch, b.prompt_index, b.group_id)
    assert [r.uid for r in a.rollouts] == [r.uid for r in b.rollouts]
    for x, y in zip(a.rollouts, b.rollouts):
        assert x.policy_version == y.policy_version and x.reward == y.reward and x.worker_id == y.worker_id
        for name in ("prompt_ids", "response_ids", "logprobs"):
            tx, ty = getattr(x, name), getattr(y, name)
            assert tx.dtype == ty.dtype and torch.equal(tx, ty), name


def drain(pool: RolloutPool, *, max_rounds: int = 1000) -> list[Group]:
    """Grants, delivers fresh groups and takes until the epoch is consumed."""
    out: list[Group] = []
    for _ in range(max_rounds):
        pool.grant("drain", pool.capacity, now=0.0)
        for lease in list(pool.ledger.leases.values()):
            deliver(pool, lease)
        while True:
            try:
                g = take(pool, timeout=0)
            except StopIteration:
                return out
            if g is None:
                break
            out.append(g)
    raise AssertionError("epoch did not finish")


# ----------------------------------------------------------------------------------------------------------------------
# construction


def test_constructor_validates():
    ledger = PromptLedger(4)
    with pytest.raises(ValueError):
        RolloutPool(ledger, group_size=0, capacity=4)
    with pytest.raises(ValueError):
        RolloutPool(ledger, group_size=2, capacity=0)
    with pytest.raises(ValueError):
        RolloutPool(ledger, group_size=2, capacity=4, max_staleness=-1)
    RolloutPool(ledger, group_size=2, capacity=4, max_staleness=0)


def test_make_group_helper_is_valid_on_the_wire():
    g = make_group(1, 3, 4, 7)
    back = Group.from_wire(g.to_wire(), group_size=4)
    assert_groups_equal(g, back)
    assert all(r.prompt_ids.dtype == torch.int32 and r.logprobs.dtype == torch.float32 for r in g.rollouts)
    assert all(bool((r.logprobs <= 0).all()) for r in g.rollouts)


# ----------------------------------------------------------------------------------------------------------------------
# grants and capacity


def test_nothing_granted_before_start_epoch():
    pool = make_pool(start=False)
    assert pool.active is False
    assert pool.grant("w0", 4, now=0.0) == []
    assert pool.ledger.leases == {}
    pool.start_epoch(0)
    assert pool.active is True
    assert len(pool.grant("w0", 4, now=0.0)) == 4


def test_grant_respects_want_and_capacity():
    pool = make_pool(num_prompts=10, capacity=4)
    a = pool.grant("w0", 1, now=0.0)
    assert len(a) == 1
    b = pool.grant("w1", 2, now=0.0)
    assert len(b) == 2
    c = pool.grant("w1", 10, now=0.0)
    assert len(c) == 1  # capacity 4 reached
    assert pool.groups_in_flight == 4
    assert pool.grant("w2", 10, now=0.0) == []
    leases = a + b + c
    assert [l.prompt_index for l in leases] == pool.ledger.order[:4]

    # a complete group stays in flight until the trainer takes it
    deliver(pool, leases[0])
    assert pool.groups_in_flight == 4
    assert pool.grant("w2", 10, now=0.0) == []
    got = take(pool, timeout=0.05)
    assert got.prompt_index == leases[0].prompt_index
    assert pool.groups_in_flight == 3
    more = pool.grant("w2", 10, now=0.0)
    assert [l.prompt_index for l in more] == [pool.ledger.order[4]]
    assert pool.groups_in_flight == 4
    assert pool.grant("w2", 10, now=0.0) == []
    # an expired lease frees its slot
    pool.expire(now=math.inf)
    assert pool.groups_in_flight == 0
    assert len(pool.grant("w2", 10, now=1.0)) == 4


def test_partial_group_counts_against_capacity():
    pool = make_pool(num_prompts=10, capacity=2)
    a, b = pool.grant("w0", 2, now=0.0)
    g = make_group(0, a.prompt_index, 2, 0)
    assert pool.add_rollouts(g.rollouts[:1], lease_id=a.lease_id) == 1
    assert pool.groups_in_flight >= 2
    assert pool.grant("w1", 5, now=0.0) == []
    assert pool.add_rollouts(g.rollouts[1:], lease_id=a.lease_id) == 1
    assert pool.groups_in_flight == 2  # one buffered, one leased
    assert pool.grant("w1", 5, now=0.0) == []


def test_grant_capacity_exact_with_whole_groups():
    pool = make_pool(num_prompts=10, capacity=3)
    for _ in range(20):
        pool.grant("w", 10, now=0.0)
        assert pool.groups_in_flight <= 3
        for lease in list(pool.ledger.leases.values())[:2]:
            deliver(pool, lease)
        assert pool.groups_in_flight <= 3
        try:
            take(pool, timeout=0)
        except StopIteration:
            break
    assert pool.peak["groups_in_flight"] == 3


def test_grant_stops_above_max_buffer_bytes():
    ledger = PromptLedger(10)
    pool = RolloutPool(ledger, group_size=2, capacity=10, max_buffer_bytes=1)
    pool.start_epoch(0)
    (lease,) = pool.grant("w", 1, now=0.0)
    assert len(pool.grant("w", 1, now=0.0)) == 1  # nothing buffered yet
    deliver(pool, lease)
    assert pool.grant("w", 5, now=0.0) == []
    take(pool, timeout=0)
    assert len(pool.grant("w", 1, now=0.0)) == 1


# ----------------------------------------------------------------------------------------------------------------------
# receiving and taking


def test_whole_group_is_taken():
    pool = make_pool()
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = deliver(pool, lease)
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.BUFFERED
    assert pool.stats["groups_received"] == 1 and pool.stats["rollouts_received"] == 2
    assert pool.buffered_bytes == group.nbytes
    got = take(pool, timeout=0.05)
    assert_groups_equal(group, got)
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.CONSUMED
    assert pool.buffered_bytes == 0
    assert pool.stats["groups_yielded"] == 1
    assert lease.lease_id not in pool.ledger.leases


def test_rollouts_of_a_group_in_any_order():
    pool = make_pool(group_size=3)
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = make_group(0, lease.prompt_index, 3, 0)
    assert pool.add_rollouts(list(reversed(group.rollouts)), lease_id=lease.lease_id) == 3
    got = take(pool, timeout=0.05)
    assert [r.sample_index for r in got.rollouts] == [0, 1, 2]


def test_duplicates_are_counted_and_not_yielded_twice():
    pool = make_pool()
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = deliver(pool, lease)
    # the same group again, before and after the trainer took it
    assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["duplicate"] == 2
    assert take(pool, timeout=0.05).group_id == group.group_id
    assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["duplicate"] == 4
    assert take(pool, timeout=0.05) is None
    assert pool.stats["groups_yielded"] == 1 and pool.stats["groups_received"] == 1


def test_duplicate_uid_within_partial_group():
    pool = make_pool(group_size=3)
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = make_group(0, lease.prompt_index, 3, 0)
    r0 = group.rollouts[0]
    assert pool.add_rollouts([r0, r0], lease_id=lease.lease_id) == 1
    assert pool.add_rollouts([r0], lease_id=lease.lease_id) == 0
    assert pool.stats["duplicate"] == 2
    assert take(pool, timeout=0.05) is None
    assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == 2
    assert pool.stats["duplicate"] == 3
    got = take(pool, timeout=0.05)
    assert [r.uid for r in got.rollouts] == [r.uid for r in group.rollouts]
    assert take(pool, timeout=0.05) is None


def test_wrong_epoch_not_in_shard_and_bad_sample_index():
    pool = make_pool(num_prompts=8, rank=0, world_size=2)
    (lease,) = pool.grant("w0", 1, now=0.0)
    wrong = make_group(1, lease.prompt_index, 2, 0)
    assert pool.add_rollouts(wrong.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["wrong_epoch"] == 2
    other = next(i for i in range(8) if i not in pool.ledger.order)
    assert pool.add_rollouts(make_group(0, other, 2, 0).rollouts) == 0
    assert pool.stats["not_in_shard"] == 2
    too_big = make_group(0, lease.prompt_index, 3, 0).rollouts[2]
    assert pool.add_rollouts([too_big], lease_id=lease.lease_id) == 0
    assert pool.stats["bad_sample_index"] == 1
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.LEASED
    assert take(pool, timeout=0.05) is None


def test_group_in_two_halves_completes():
    pool = make_pool(group_size=4)
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = make_group(0, lease.prompt_index, 4, 0)
    assert pool.add_rollouts(group.rollouts[:2], lease_id=lease.lease_id) == 2
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.LEASED
    assert take(pool, timeout=0.05) is None
    assert pool.add_rollouts(group.rollouts[2:], lease_id=lease.lease_id) == 2
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.BUFFERED
    assert_groups_equal(group, take(pool, timeout=0.05))


def test_group_completed_by_two_workers_after_expiry():
    pool = make_pool(group_size=2, lease_timeout_s=10.0)
    (first,) = pool.grant("w0", 1, now=0.0)
    g = make_group(0, first.prompt_index, 2, 0)
    pool.add_rollouts(g.rollouts[:1], lease_id=first.lease_id)
    assert pool.expire(now=10.0) == [first]
    (second,) = pool.grant("w1", 1, now=11.0)
    assert second.prompt_index == first.prompt_index and second.attempt == 1
    pool.add_rollouts(make_group(0, first.prompt_index, 2, 0, worker_id="w1").rollouts, lease_id=second.lease_id)
    assert pool.stats["duplicate"] == 1
    got = take(pool, timeout=0.05)
    assert [r.worker_id for r in got.rollouts] == ["w0", "w1"]
    assert pool.ledger.leases == {}


def test_superseded_lease_ids_rejected_after_new_epoch():
    pool = make_pool()
    (lease,) = pool.grant("w0", 1, now=0.0)
    pool.start_epoch(0)  # abandons the timeline
    g = make_group(0, lease.prompt_index, 2, 0)
    assert pool.add_rollouts(g.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["superseded"] == 2


def test_take_timeout_returns_none_when_empty():
    pool = make_pool()
    assert take(pool, timeout=0.05) is None
    pool.grant("w0", 2, now=0.0)
    assert take(pool, timeout=0.05) is None


def test_take_raises_stop_iteration_at_epoch_end():
    pool = make_pool(num_prompts=3, capacity=8)
    leases = pool.grant("w0", 8, now=0.0)
    assert len(leases) == 3
    for lease in leases:
        deliver(pool, lease)
    got = [take(pool, timeout=0.05) for _ in range(3)]
    assert sorted(g.prompt_index for g in got) == [0, 1, 2]
    with pytest.raises(StopIteration):
        take(pool, timeout=0.05)
    assert pool.grant("w0", 8, now=0.0) == []


def test_take_yields_in_arrival_order():
    pool = make_pool(num_prompts=5, capacity=5)
    leases = pool.grant("w0", 5, now=0.0)
    for lease in reversed(leases):
        deliver(pool, lease)
    assert [take(pool, timeout=0).prompt_index for _ in range(5)] == [l.prompt_index for l in reversed(leases)]


def test_fail_makes_take_raise():
    pool = make_pool()
    pool.fail(OSError("boom"))
    with pytest.raises(RuntimeError) as exc:
        take(pool, timeout=0.05)
    assert isinstance(exc.value.__cause__, OSError)


# ----------------------------------------------------------------------------------------------------------------------
# staleness


@pytest.mark.parametrize("k", [0, 1, 2])
def test_set_policy_version_drops_stale_and_releases(k):
    pool = make_pool(num_prompts=10, capacity=10, max_staleness=k)
    leases = pool.grant("w0", 4, now=0.0)
    for v, lease in enumerate(leases):
        pool.set_policy_version(v)  # a rollout is never newer than the trainer
        deliver(pool, lease, policy_version=v)  # versions 0..3
    pool.set_policy_version(3)
    stale = [l for v, l in enumerate(leases) if v < 3 - k]
    fresh = [l for v, l in enumerate(leases) if v >= 3 - k]
    assert pool.stats["stale_dropped"] == len(stale)
    assert pool.ledger.counters["requeued_stale"] == len(stale)
    for l in stale:
        assert pool.ledger.state_of(l.prompt_index) is PromptState.PENDING
    for l in fresh:
        assert pool.ledger.state_of(l.prompt_index) is PromptState.BUFFERED
    # stale prompts are re-leased first
    again = pool.grant("w1", len(stale), now=1.0)
    assert [l.prompt_index for l in again] == [l.prompt_index for l in stale]
    assert all(l.attempt == 1 for l in again)
    assert pool.ledger.counters["regenerated"] == len(stale)
    got = [take(pool, timeout=0).prompt_index for _ in fresh]
    assert got == [l.prompt_index for l in fresh]
    assert take(pool, timeout=0) is None
    # regenerated ones arrive fresh and are yielded
    for l in again:
        deliver(pool, l)
    got = [take(pool, timeout=0) for _ in again]
    assert [g.prompt_index for g in got] == [l.prompt_index for l in again]
    assert all(g.policy_version == 3 for g in got)


def test_take_drops_group_that_arrived_stale():
    pool = make_pool(num_prompts=6, capacity=6, max_staleness=1)
    pool.set_policy_version(5)
    a, b = pool.grant("w0", 2, now=0.0)
    deliver(pool, a, policy_version=3)  # 2 behind
    deliver(pool, b, policy_version=4)  # 1 behind
    got = take(pool, timeout=0.05)
    assert got.prompt_index == b.prompt_index and got.policy_version == 4
    assert pool.stats["stale_dropped"] == 1
    assert pool.ledger.state_of(a.prompt_index) is PromptState.PENDING
    assert take(pool, timeout=0.05) is None
    (again,) = pool.grant("w0", 1, now=0.0)
    assert again.prompt_index == a.prompt_index


def test_stale_by_oldest_rollout():
    pool = make_pool(num_prompts=4, max_staleness=0)
    pool.set_policy_version(2)
    (lease,) = pool.grant("w0", 1, now=0.0)
    g = make_group(0, lease.prompt_index, 2, 2)
    g.rollouts[1].policy_version = 1  # one rollout is older
    pool.add_rollouts(g.rollouts, lease_id=lease.lease_id)
    assert take(pool, timeout=0) is None
    assert pool.stats["stale_dropped"] == 1


def test_unbounded_staleness_never_drops():
    pool = make_pool(num_prompts=4, max_staleness=None)
    (lease,) = pool.grant("w0", 1, now=0.0)
    deliver(pool, lease, policy_version=0)
    pool.set_policy_version(1000)
    assert take(pool, timeout=0).prompt_index == lease.prompt_index
    assert pool.stats["stale_dropped"] == 0


def test_set_policy_version_monotonic():
    pool = make_pool(max_staleness=1)
    pool.set_policy_version(3)
    pool.set_policy_version(3)  # equal is a no-op
    assert pool.policy_version == 3
    with pytest.raises(ValueError) as exc:
        pool.set_policy_version(2)
    assert "2" in str(exc.value) and "3" in str(exc.value)
    assert pool.policy_version == 3
    with pytest.raises(TypeError):
        pool.set_policy_version(4.0)


# ----------------------------------------------------------------------------------------------------------------------
# property test: random interleavings keep the guarantees

OPS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 1000), st.integers(0, 1000)),
    min_size=10,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 3),
    capacity=st.integers(1, 6),
    seed=st.integers(0, 3),
    ops=OPS,
)
def test_random_interleavings_keep_guarantees(k, capacity, seed, ops):
    group_size = 2
    pool = make_pool(num_prompts=12, group_size=group_size, capacity=capacity, max_staleness=k, seed=seed)
    shard = list(pool.ledger.order)
    tv = 0
    yielded: list[int] = []
    yielded_ids: set[str] = set()
    finished = False

    def record(g: Group) -> None:
        assert g.policy_version >= tv - k, f"stale group {g.group_id} v{g.policy_version} at trainer v{tv}, k={k}"
        assert g.group_id not in yielded_ids, f"{g.group_id} yielded twice"
        assert len(g.rollouts) == group_size
        yielded_ids.add(g.group_id)
        yielded.append(g.prompt_index)

    for op, a, b in ops:
        if op == 0:
            want = 1 + b % 3
            before = pool.groups_in_flight
            got = pool.grant(f"w{a % 3}", want, now=0.0)
            assert len(got) <= want
            assert len(got) <= max(0, capacity - before)
        elif op == 1:
            leases = sorted(pool.ledger.leases.values(), key=lambda l: l.lease_id)
            if leases:
                lease = leases[a % len(leases)]
                pv = max(0, tv - b % 6)
                g = make_group(0, lease.prompt_index, group_size, pv, worker_id=lease.worker_id)
                assert pool.add_rollouts(g.rollouts, lease_id=lease.lease_id) == group_size
        elif op == 2:
            tv += a % 3
            pool.set_policy_version(tv)
        elif op == 3:
            try:
                g = take(pool, timeout=0)
            except StopIteration:
                finished = True
            else:
                if g is not None:
                    record(g)
        elif op == 4:
            pool.expire(now=math.inf)
            assert pool.ledger.leases == {}
        else:
            w = f"w{a % 3}"
            pool.release_worker(w)
            assert all(l.worker_id != w for l in pool.ledger.leases.values())
        assert pool.groups_in_flight <= capacity
        assert pool.buffered_bytes >= 0
        # every prompt of the shard is somewhere
        assert all(pool.ledger.state_of(i) is not None for i in shard)

    # drain
    for _ in range(500):
        if finished:
            break
        pool.grant("drain", capacity, now=0.0)
        for lease in list(pool.ledger.leases.values()):
            g = make_group(0, lease.prompt_index, group_size, tv, worker_id=lease.worker_id)
            assert pool.add_rollouts(g.rollouts, lease_id=lease.lease_id) == group_size
        assert pool.groups_in_flight <= capacity
        while True:
            try:
                g = take(pool, timeout=0)
            except StopIteration:
                finished = True
                break
            if g is None:
                break
            record(g)
    assert finished, "epoch never finished"
    assert len(yielded) == len(set(yielded))
    assert sorted(yielded) == sorted(shard)
    assert pool.ledger.epoch_done
    assert pool.stats["groups_yielded"] == len(shard)
    assert pool.buffered_bytes == 0


# ----------------------------------------------------------------------------------------------------------------------
# state dict


def test_state_dict_roundtrip_into_new_pool():
    pool = make_pool(num_prompts=10, group_size=2, capacity=6, max_staleness=2, seed=4)
    pool.set_policy_version(1)
    leases = pool.grant("w0", 6, now=0.0)
    delivered = {l.prompt_index: deliver(pool, l, policy_version=1) for l in leases[:4]}
    # a half-received group
    half = make_group(0, leases[4].prompt_index, 2, 1)
    pool.add_rollouts(half.rollouts[:1], lease_id=leases[4].lease_id)
    taken = [take(pool, timeout=0) for _ in range(2)]
    before = [g.prompt_index for g in taken]
    assert before == [l.prompt_index for l in leases[:2]]
    ready_before = {i: delivered[i] for i in (leases[2].prompt_index, leases[3].prompt_index)}

    state = pool.state_dict()
    assert state["group_size"] == 2 and state["policy_version"] == 1
    assert len(state["ready"]) == 2 and len(state["partial"]) == 1

    fresh = make_pool(num_prompts=10, group_size=2, capacity=6, max_staleness=2, seed=4, start=False)
    assert not fresh.active
    fresh.load_state_dict(state)
    assert fresh.active
    assert fresh.policy_version == 1
    assert fresh.stats == pool.stats
    assert fresh.buffered_bytes == pool.buffered_bytes
    assert fresh.ledger.leases == {}
    assert fresh.ledger.num_consumed == 2
    for i in ready_before:
        assert fresh.ledger.state_of(i) is PromptState.BUFFERED
    for l in leases[4:]:
        assert fresh.ledger.state_of(l.prompt_index) is PromptState.PENDING

    # buffered groups survive, bit for bit, in order
    after = []
    for i, g in ready_before.items():
        got = take(fresh, timeout=0)
        assert_groups_equal(g, got)
        after.append(got.prompt_index)

    # the partial group's saved rollout survives too: the regenerated duplicate sample is rejected
    again = fresh.grant("w9", 2, now=0.0)
    assert [l.prompt_index for l in again] == [leases[4].prompt_index, leases[5].prompt_index]
    regen = make_group(0, leases[4].prompt_index, 2, 1, worker_id="w9")
    regen.rollouts[0].reward = 123.0  # distinguishable: must be dropped as a duplicate uid
    assert fresh.add_rollouts(regen.rollouts, lease_id=again[0].lease_id) == 1
    g4 = take(fresh, timeout=0)
    assert g4.prompt_index == leases[4].prompt_index
    assert g4.rollouts[0].reward == half.rollouts[0].reward
    assert torch.equal(g4.rollouts[0].response_ids, half.rollouts[0].response_ids)
    after.append(g4.prompt_index)

    after += [g.prompt_index for g in drain(fresh)]
    union = before + after
    assert len(union) == len(set(union))
    assert sorted(union) == sorted(fresh.ledger.order) == list(range(10))
    with pytest.raises(StopIteration):
        take(fresh, timeout=0)


def test_state_dict_roundtrip_through_codec():
    from asyncrl.codec import decode, encode

    pool = make_pool(num_prompts=6, group_size=3, capacity=6)
    leases = pool.grant("w0", 3, now=0.0)
    groups = [deliver(pool, l) for l in leases]
    frames = [bytes(f) for f in encode("state", pool.state_dict())]
    _, state = decode(frames)
    fresh = make_pool(num_prompts=6, group_size=3, capacity=6, start=False)
    fresh.load_state_dict(state)
    for g in groups:
        assert_groups_equal(g, take(fresh, timeout=0))
    rest = drain(fresh)
    assert sorted([g.prompt_index for g in groups + rest]) == list(range(6))


def test_load_state_dict_rejects_other_group_size():
    pool = make_pool(group_size=2)
    (lease,) = pool.grant("w0", 1, now=0.0)
    deliver(pool, lease)
    state = pool.state_dict()
    other = make_pool(group_size=4, start=False)
    with pytest.raises(ValueError, match="group_size"):
        other.load_state_dict(state)
    assert not other.active
    bad = dict(state, version=RolloutPool.STATE_VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        make_pool(group_size=2, start=False).load_state_dict(bad)


def test_load_state_dict_rejects_other_ledger_params():
    pool = make_pool(num_prompts=8, seed=1)
    state = pool.state_dict()
    with pytest.raises(ValueError, match="seed"):
        make_pool(num_prompts=8, seed=2, start=False).load_state_dict(state)


# ----------------------------------------------------------------------------------------------------------------------
# regressions: bugs found by these tests, fixed


def test_group_arriving_before_its_lease_is_not_leased_again():
    pool = make_pool(num_prompts=4, capacity=4)
    ahead = pool.ledger.order[-1]
    g = make_group(0, ahead, 2, 0)
    assert pool.add_rollouts(g.rollouts) == 2  # accepted: first complete group wins
    assert take(pool, timeout=0).prompt_index == ahead
    leases = pool.grant("w0", 4, now=0.0)
    assert ahead not in [l.prompt_index for l in leases]


# ----------------------------------------------------------------------------------------------------------------------
# property test: a crash and resume from a state dict in the middle of random traffic


class Driver:
    """Applies random ops to a pool and checks the trainer-side guarantees on what it yields."""

    def __init__(self, pool: RolloutPool, k: int, yielded: list[int] | None = None):
        self.pool, self.k = pool, k
        self.yielded: list[int] = list(yielded or [])
        self.issued: list = []  # every lease this pool granted
        self.finished = False

    @property
    def tv(self) -> int:
        return self.pool.policy_version

    def record(self, g: Group) -> None:
        assert g.policy_version >= self.tv - self.k, f"stale {g.group_id} v{g.policy_version} at v{self.tv}"
        assert g.prompt_index not in self.yielded, f"{g.group_id} yielded twice"
        self.yielded.append(g.prompt_index)

    def deliver(self, lease, pv: int) -> int:
        """Delivers a whole group as the ZeroMQ receiver does: add, then release the lease if still held."""
        g = make_group(lease.epoch, lease.prompt_index, self.pool.group_size, pv, worker_id=lease.worker_id)
        accepted = self.pool.add_rollouts(g.rollouts, lease_id=lease.lease_id)
        self.pool.release_held(lease.lease_id, lease.worker_id, "rejected")
        return accepted

    def take(self) -> Group | None:
        try:
            g = take(self.pool, timeout=0)
        except StopIteration:
            self.finished = True
            return None
        if g is not None:
            self.record(g)
        return g

    def apply(self, op: int, a: int, b: int) -> None:
        pool = self.pool
        if op == 0:
            self.issued += pool.grant(f"w{a % 3}", 1 + b % 3, now=0.0)
        elif op == 1:
            leases = sorted(pool.ledger.leases.values(), key=lambda l: l.lease_id)
            if leases:
                self.deliver(leases[a % len(leases)], max(0, self.tv - b % 6))
        elif op == 2:
            pool.set_policy_version(self.tv + a % 3)
        elif op == 3:
            self.take()
        elif op == 4:
            pool.expire(now=math.inf)
        else:
            pool.release_worker(f"w{a % 3}")

    def drain(self) -> None:
        for _ in range(500):
            if self.finished:
                return
            self.pool.grant("drain", self.pool.capacity, now=0.0)
            for lease in list(self.pool.ledger.leases.values()):
                self.deliver(lease, self.tv)
            while self.take() is not None:
                pass
        assert self.finished, "epoch never finished"


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(0, 3),
    capacity=st.integers(1, 6),
    seed=st.integers(0, 3),
    before=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000), st.integers(0, 1000)), max_size=50),
    lost=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000), st.integers(0, 1000)), max_size=30),
    after=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 1000), st.integers(0, 1000)), min_size=5, max_size=50
    ),
)
def test_random_crash_and_resume_exactly_once(k, capacity, seed, before, lost, after):
    """Save mid-traffic; the old pool runs on (its yields are lost with the crashed trainer) and its workers
    keep delivering late groups to the resumed pool. Every prompt is still consumed exactly once."""
    from asyncrl.codec import decode, encode

    params = dict(num_prompts=12, group_size=2, capacity=capacity, max_staleness=k, seed=seed)
    old = Driver(make_pool(**params), k)
    for op in before:
        old.apply(*op)
    if old.finished:
        return
    state = decode([bytes(f) for f in encode("state", old.pool.state_dict())])[1]
    saved_yields = list(old.yielded)
    for op in lost:
        old.apply(*op)

    new = Driver(make_pool(**params, start=False), k, yielded=saved_yields)
    new.pool.load_state_dict(state)
    assert new.tv == state["policy_version"]
    for op, a, b in after:
        if op == 6:  # a late group from a worker of the crashed run
            if old.issued:
                new.deliver(old.issued[a % len(old.issued)], max(0, new.tv - b % 6))
        else:
            new.apply(op, a, b)
    new.drain()
    shard = new.pool.ledger.order
    assert sorted(new.yielded) == sorted(shard)
    assert len(new.yielded) == len(set(new.yielded))


def test_partial_group_with_its_lease_counts_once():
    pool = make_pool(num_prompts=4, capacity=1)
    (lease,) = pool.grant("w0", 1, now=0.0)
    g = make_group(0, lease.prompt_index, 2, 0)
    pool.add_rollouts(g.rollouts[:1], lease_id=lease.lease_id)
    assert pool.groups_in_flight <= pool.capacity
    assert pool.peak["groups_in_flight"] <= pool.capacity


@pytest.mark.parametrize("via", ["expire", "worker_lost", "resume"])
def test_orphaned_partial_group_does_not_stall_the_epoch(via):
    pool = make_pool(num_prompts=3, capacity=1, lease_timeout_s=10.0)
    (lease,) = pool.grant("w0", 1, now=0.0)
    g = make_group(0, lease.prompt_index, 2, 0)
    assert pool.add_rollouts(g.rollouts[:1], lease_id=lease.lease_id) == 1
    if via == "expire":
        pool.expire(now=10.0)
    elif via == "worker_lost":
        pool.release_worker("w0")
    else:  # the trainer checkpointed here and resumed in a new process
        state = pool.state_dict()
        pool = make_pool(num_prompts=3, capacity=1, lease_timeout_s=10.0, start=False)
        pool.load_state_dict(state)
    assert pool.ledger.leases == {}
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.PENDING
    # the prompt must be leased again so that its missing sample gets generated
    again = pool.grant("w1", 1, now=20.0)
    assert [l.prompt_index for l in again] == [lease.prompt_index]


def test_ordered_pool_yields_in_ledger_order_whatever_the_arrival_order():
    pool = make_pool(num_prompts=6, capacity=6)
    pool.ordered = True
    leases = pool.grant("w0", 6, now=0.0)
    assert [lease.prompt_index for lease in leases] == pool.ledger.order
    for lease in reversed(leases):  # the last leased arrives first
        pool.add_rollouts(make_group(0, lease.prompt_index, 2, 0).rollouts, lease_id=lease.lease_id)
    assert [take(pool, 0.01).prompt_index for _ in range(6)] == pool.ledger.order

    pool = make_pool(num_prompts=3, capacity=3)
    pool.ordered = True
    first, second, _ = pool.grant("w0", 3, now=0.0)
    pool.add_rollouts(make_group(0, second.prompt_index, 2, 0).rollouts, lease_id=second.lease_id)
    assert take(pool, 0.05) is None, "the head of the order has not arrived: nothing may overtake it"


# ----------------------------------------------------------------------------------------------------------------------
# leasing within the staleness bound (groups_per_step)


def fresh_pool(max_staleness: int | None, groups_per_step: int = 2, capacity: int = 16) -> RolloutPool:
    pool = RolloutPool(PromptLedger(64, seed=0), group_size=2, capacity=capacity, max_staleness=max_staleness,
                       groups_per_step=groups_per_step)
    pool.start_epoch(0)
    return pool


def test_synchronous_pool_leases_one_step_at_a_time():
    pool = fresh_pool(max_staleness=0, groups_per_step=2)
    leases = pool.grant("w", 8)
    assert len(leases) == 2  # one step's groups, not the capacity's 16
    for lease in leases:
        deliver(pool, lease)
    assert [take(pool, 0) is not None for _ in range(2)] == [True, True]
    assert pool.grant("w", 8) == []  # training on version 0: anything leased now would arrive stale
    pool.set_policy_version(1)
    assert len(pool.grant("w", 8)) == 2


def test_rejected_update_does_not_deadlock_the_synchronous_pool():
    pool = fresh_pool(max_staleness=0, groups_per_step=2)
    for lease in pool.grant("w", 8):
        deliver(pool, lease)
    take(pool, 0), take(pool, 0)
    assert pool.grant("w", 8) == []
    assert take(pool, 0) is None  # the next step starts at the same version (update rejected) ...
    assert len(pool.grant("w", 8)) == 2  # ... and may lease its groups


@pytest.mark.parametrize("k", [1, 2])
def test_k_step_pool_keeps_in_flight_within_the_bound_and_nothing_goes_stale(k):
    pool = fresh_pool(max_staleness=k, groups_per_step=2)
    for step in range(10):
        for lease in pool.grant("w", 64):
            deliver(pool, lease)  # stamped with the version at grant time, as a worker that caught up
        assert pool.groups_in_flight <= (k + 1) * 2
        assert take(pool, 0) is not None and take(pool, 0) is not None
        pool.set_policy_version(step + 1)
    assert pool.stats["stale_dropped"] == 0


def test_unbounded_staleness_ignores_groups_per_step():
    pool = fresh_pool(max_staleness=None, groups_per_step=2, capacity=6)
    assert len(pool.grant("w", 64)) == 6


def test_grant_says_why_it_leased_fewer_than_asked():
    """``withheld``: the window (groups leased and buffered the trainer has not taken), the capacity, or nothing
    left to lease; None when every credit asked for was granted."""
    window = fresh_pool(max_staleness=1, groups_per_step=2, capacity=16)
    assert len(window.grant("w", 3)) == 3 and window.withheld is None
    assert len(window.grant("w", 8)) == 1 and window.withheld == "window"  # (1 + 1) x 2 in flight
    for lease in list(window.ledger.leases.values()):
        deliver(window, lease)
    assert window.grant("w", 1) == [] and window.withheld == "window"  # buffered, not taken: still the window
    assert take(window, 0) is not None and take(window, 0) is not None
    window.set_policy_version(1)  # the trainer took a step's groups and moved on: the window opens
    assert len(window.grant("w", 2)) == 2 and window.withheld is None
    capacity = fresh_pool(max_staleness=None, capacity=3)
    assert len(capacity.grant("w", 5)) == 3 and capacity.withheld == "capacity"
    tail = RolloutPool(PromptLedger(2, seed=0), group_size=2, capacity=16)
    assert tail.grant("w", 1) == [] and tail.withheld == "no_prompt"  # the loader has not started the epoch
    tail.start_epoch(0)
    assert len(tail.grant("w", 5)) == 2 and tail.withheld == "no_prompt"


def test_leases_cancelled_by_a_reset_are_remembered_per_worker():
    pool = make_pool(8, capacity=4)
    leases = pool.grant("w0", 2, now=0.0) + pool.grant("w1", 1, now=0.0)
    pool.load_state_dict(pool.state_dict())  # a live load: every outstanding lease is cancelled
    for lease in leases:
        assert pool.cancelled_lease_of(lease.lease_id, lease.worker_id)
        assert not pool.cancelled_lease_of(lease.lease_id, "someone-else")  # a forger naming the lease: not excused
    fresh = pool.grant("w0", 1, now=0.0)[0]
    assert not pool.cancelled_lease_of(fresh.lease_id, "w0")


def test_rollouts_ahead_of_a_resumed_trainer_name_the_resume_not_the_call_order(caplog):
    """Workers that outlived the previous run hold its newer weights; after a resume from an older checkpoint the
    refusal used to say "call set_policy_version(v) before publishing version v", which is not what happened."""
    old = make_pool(4, capacity=4)
    old.set_policy_version(3)
    state = old.state_dict()
    pool = RolloutPool(PromptLedger(4), group_size=2, capacity=4)  # the resumed trainer: a new incarnation
    pool.load_state_dict(state)
    lease = pool.grant("w0", 1, now=0.0)[0]
    group = make_group(lease.epoch, lease.prompt_index, 2, policy_version=6)  # the old run's newer weights
    for r in group.rollouts:
        r.incarnation = old.incarnation
    with caplog.at_level("WARNING"):
        assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["ahead_of_trainer"] == 2
    assert "before it resumed from an older checkpoint" in caplog.text
    assert "incarnation=loader.incarnation" in caplog.text
    assert "call set_policy_version(v) before publishing" not in caplog.text


def test_ordered_delivery_leases_the_prompt_it_waits_for_even_with_the_window_full():
    """Resumed with the held batch's groups re-delivered and found stale, a later prompt queued for re-issue ahead of
    them, and a fresh later group buffered: the stale prompt, next in order, must be leased again although the window
    is full, or the ordered consumer waits for it for ever while the pool withholds every credit ("window")."""

    def fresh() -> RolloutPool:
        ledger = PromptLedger(6, seed=0, shuffle=False)
        return RolloutPool(ledger, group_size=2, capacity=8, max_staleness=1, groups_per_step=2, prefetch=1,
                           ordered=True, incarnation="run-a")

    def arrive(pool: RolloutPool, lease, version: int) -> None:
        pool.add_rollouts(make_group(0, lease.prompt_index, 2, version).rollouts, lease_id=lease.lease_id)

    before = fresh()
    before.start_epoch(0)
    first = before.grant("w", 2, now=0.0)
    for lease in first:
        arrive(before, lease, 0)
    assert [before.take(timeout=0).prompt_index for _ in range(2)] == [0, 1]  # delivered, held, not trained
    before.set_policy_version(1)
    later = before.grant("w", 2, now=0.0)
    assert [lease.prompt_index for lease in later] == [2, 3]
    arrive(before, later[1], 1)  # prompt 3's group is here; prompt 2 is still leased at the save
    pool = fresh()
    pool.load_state_dict(before.state_dict())
    assert pool.take(timeout=0) is None  # 0 and 1 were generated at version 0: stale once re-delivered at 1
    taken = []
    for _ in range(20):
        for lease in pool.grant("w", 2, now=0.0):
            arrive(pool, lease, pool.policy_version)
        g = pool.take(timeout=0)
        if g is None:
            continue
        pool.commit(g.epoch, [g.prompt_index])
        taken.append(g.prompt_index)
        if len(taken) == 6:
            break
    assert taken == [0, 1, 2, 3, 4, 5], f"ordered delivery stalled after {taken} (withheld: {pool.withheld})"
