"""asyncrl.pool.reshard: pool states saved at M trainer ranks, continued at M′ (an elastic resume).

Pools only, no sockets: M pools are driven into a mid-epoch state with every kind of prompt present (trained,
delivered but not trained, buffered, partially received, leased, pending), saved, re-dealt over M′ fresh pools and
drained. The guarantees: each prompt of the epoch trained once across both parts, the groups not yet trained
re-delivered bit for bit by their new owner (not regenerated), no rank left without work while another has two
more, counters summed, policy version and timeline continued; the shards are the ones a run at M′ from scratch
deals when what was trained is a prefix of the epoch; and what cannot be reconciled is refused with the reason.
"""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger, PromptState
from asyncrl.pool.reshard import needs_reshard, reshard
from asyncrl.pool.shards import shard_indices
from tests.unit.pool.test_pool import assert_groups_equal, deliver, make_group

GROUP = 2


def pools(world: int, num_prompts: int, *, seed: int = 3, start: bool = True, **kw) -> list[RolloutPool]:
    out = []
    for r in range(world):
        ledger = PromptLedger(num_prompts, seed=seed, rank=r, world_size=world, **kw)
        pool = RolloutPool(ledger, group_size=GROUP, capacity=64, incarnation="run-a")
        if start:
            pool.start_epoch(0)
        out.append(pool)
    return out


def resume(states: list[dict], world: int, num_prompts: int, **kw) -> list[RolloutPool]:
    """A run at ``world`` ranks resumed from ``states``: each rank loads its share of the re-dealt epoch."""
    new = pools(world, num_prompts, start=False, **kw)
    for pool in new:
        pool.load_state_dict(reshard(states, pool.ledger))
    return new


def train(pool: RolloutPool, n: int) -> list[int]:
    """Takes ``n`` groups and commits them (a loop that trains each batch before it fetches the next)."""
    out = []
    for _ in range(n):
        g = pool.take(timeout=0)
        assert g is not None
        pool.commit(g.epoch, [g.prompt_index])
        out.append(g.prompt_index)
    return out


def drain(pool: RolloutPool, version: int = 0) -> list[int]:
    """Generates and trains whatever is left of the epoch on this rank."""
    out = []
    while True:
        for lease in pool.grant("w-new", 64, now=0.0):  # a saved partial group's sample is refused as a duplicate
            pool.add_rollouts(make_group(lease.epoch, lease.prompt_index, GROUP, version).rollouts, lease_id=lease.lease_id)
        try:
            g = pool.take(timeout=0)
        except StopIteration:
            return out
        assert g is not None, "nothing to take and the epoch is not over"
        pool.commit(g.epoch, [g.prompt_index])
        out.append(g.prompt_index)


def mid_epoch(world: int, num_prompts: int, **kw) -> tuple[list[RolloutPool], dict]:
    """Every rank with prompts trained, delivered and not trained, buffered, partial, leased and pending."""
    ranks = pools(world, num_prompts, **kw)
    seen: dict = {"trained": [], "held": {}, "partial": {}}
    for pool in ranks:
        leases = pool.grant(f"w{pool.ledger.rank}", 7, now=0.0)
        groups = {lease.prompt_index: deliver(pool, lease) for lease in leases[:4]}
        half = make_group(0, leases[4].prompt_index, GROUP, 0)
        pool.add_rollouts(half.rollouts[:1], lease_id=leases[4].lease_id)
        seen["partial"][leases[4].prompt_index] = half.rollouts[0]
        seen["trained"] += train(pool, 1)
        held = pool.take(timeout=0)  # delivered, its update not committed: trained after the resume
        seen["held"] |= {i: groups[i] for i in groups if i not in seen["trained"]}
        assert held.prompt_index in seen["held"]
    return ranks, seen


def test_a_mid_epoch_state_resumed_at_another_number_of_ranks_trains_each_prompt_once():
    for world, new_world in [(2, 1), (1, 2), (2, 3), (3, 2)]:
        ranks, seen = mid_epoch(world, 30)
        states = [p.state_dict() for p in ranks]
        resumed = resume(states, new_world, 30)
        orders = [p.ledger.order for p in resumed]
        assert sorted(itertools.chain(*orders)) == list(range(30))  # disjoint, the whole epoch
        for p in resumed:
            for i in seen["trained"]:
                assert p.ledger.state_of(i) in (None, PromptState.CONSUMED)
        left = [sum(p.ledger.state_of(i) is not PromptState.CONSUMED for i in p.ledger.order) for p in resumed]
        assert max(left) - min(left) <= 1 and min(left) > 0, left  # no rank idle for lack of a shard
        # the groups not trained yet come back bit for bit from the rank that now owns them, first
        redelivered = {}
        for p in resumed:
            while p._ready:
                g = p.take(timeout=0)
                redelivered[g.prompt_index] = g
                p.commit(g.epoch, [g.prompt_index])
        assert set(redelivered) == set(seen["held"])
        for i, g in seen["held"].items():
            assert_groups_equal(g, redelivered[i])
        # the partial group's saved rollout is kept by its new owner (the regenerated duplicate is refused)
        for i, rollout in seen["partial"].items():
            (owner,) = [p for p in resumed if p.ledger.state_of(i) is not None]
            assert [r.uid for r in owner._partial[i].values()] == [rollout.uid]
        after = list(redelivered) + [i for p in resumed for i in drain(p)]
        counts = collections.Counter(seen["trained"] + after)
        assert set(counts) == set(range(30)) and set(counts.values()) == {1}, (world, new_world)
        # counters: summed over the new ranks as they were over the saved ones; the moves are counted
        before = sum((collections.Counter(s["stats"]) for s in states), collections.Counter())
        after_stats = sum((collections.Counter(p.stats) for p in resumed), collections.Counter())
        assert after_stats["resharded"] == new_world
        assert after_stats["groups_received"] == before["groups_received"] + len(after) - len(seen["held"])
        moved = sum(p.stats["rerouted_groups"] for p in resumed)
        assert moved == sum(_saved_rank(states, i) != _owner(resumed, i) for i in seen["held"])
        assert all(p.policy_version == 0 and p.timeline.segments[0] == ("run-a", 0) for p in resumed)


def _saved_rank(states: list[dict], prompt: int) -> int:
    return next(r for r, s in enumerate(states) if prompt in s["ledger"]["buffered"])


def _owner(resumed: list[RolloutPool], prompt: int) -> int:
    return next(r for r, p in enumerate(resumed) if p.ledger.state_of(prompt) is not None)


def test_buffered_and_delivered_groups_at_the_save_are_rerouted_not_regenerated():
    """Forced: every rank holds buffered and delivered groups at the save; after 2 -> 1 and 1 -> 2 each is trained
    from the saved tensors by exactly one rank, and no lease is issued for it."""
    ranks, seen = mid_epoch(2, 12)
    states = [p.state_dict() for p in ranks]
    assert all(s["ready"] for s in states)
    (one,) = resume(states, 1, 12)
    leased = {lease.prompt_index for lease in one.grant("w", 64, now=0.0)}
    assert not leased & set(seen["held"])
    assert one.stats["rerouted_groups"] == sum(_saved_rank(states, i) == 1 for i in seen["held"])
    two = resume([one.state_dict()], 2, 12)
    owners = collections.Counter(_owner(two, i) for i in seen["held"])
    assert sum(owners.values()) == len(seen["held"])
    for p in two:
        assert {g.prompt_index for g in p._ready.values()} == {i for i in seen["held"] if p.ledger.state_of(i)}


@given(world=st.integers(1, 3), new_world=st.integers(1, 4), num_prompts=st.integers(1, 25), seed=st.integers(0, 5),
       trained=st.lists(st.integers(0, 12), min_size=3, max_size=3), held=st.integers(0, 3),
       buffered=st.integers(0, 4), arrival=st.randoms(use_true_random=False), drop_remainder=st.booleans(),
       lengths=st.booleans())
@settings(max_examples=150, deadline=None)
def test_any_resize_trains_each_prompt_of_the_epoch_once(world, new_world, num_prompts, seed, trained, held, buffered,
                                                         arrival, drop_remainder, lengths):
    """Ranks that trained different amounts, groups arriving in any order (what was trained is no prefix of the
    epoch): the prompts left are balanced to within one per rank, and each prompt is trained once."""
    kw = {"drop_remainder": drop_remainder, "prompt_lengths": [1 + (i * 7) % 5 for i in range(num_prompts)] if lengths
          else None}
    ranks = pools(world, num_prompts, seed=seed, **kw)
    epoch = set(itertools.chain(*(p.ledger.order for p in ranks)))
    done: list[int] = []
    for pool, n in zip(ranks, trained):
        leases = pool.grant("w", n + held + buffered, now=0.0)
        for lease in arrival.sample(leases, len(leases)):
            deliver(pool, lease)
        done += train(pool, min(n, len(pool._ready)))
        for _ in range(min(held, len(pool._ready))):
            pool.take(timeout=0)
    states = [p.state_dict() for p in ranks]
    resumed = resume(states, new_world, num_prompts, seed=seed, **kw)
    left = [sum(p.ledger.state_of(i) is not PromptState.CONSUMED for i in p.ledger.order) for p in resumed]
    assert max(left) - min(left) <= 1, left
    after = [i for p in resumed for i in drain(p)]
    counts = collections.Counter(done + after)
    assert set(counts) == epoch and set(counts.values()) <= {1}
    for p in resumed:  # the next epoch is the one a run at M′ from scratch has
        p.start_epoch(1)
        assert p.ledger.order == shard_indices(num_prompts, seed=seed, epoch=1, rank=p.ledger.rank,
                                               world_size=new_world, shuffle=True, **kw)


@pytest.mark.parametrize("world,new_world", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_trained_prefix_resumes_on_the_shards_a_run_at_the_new_size_has_from_scratch(world, new_world):
    """Ordered delivery trains a prefix of the epoch; when it is a whole number of windows at M′ the resumed ledger is
    exactly the from-scratch one at that point: the same shard (saved as the standard one), the same consumed
    watermark. This is what keeps a synchronous ordered run bit-exact across a resize."""
    lengths = [1 + (i * 5) % 7 for i in range(32)]

    def ordered_run(ranks: int) -> list[RolloutPool]:
        """Every prompt generated, 8 groups of the epoch trained in order over ``ranks`` ranks."""
        out = pools(ranks, 32, prompt_lengths=lengths)
        for pool in out:
            pool.ordered = True
            for lease in pool.grant("w", 32, now=0.0):
                deliver(pool, lease)
            train(pool, 8 // ranks)
        return out

    resumed = resume([p.state_dict() for p in ordered_run(world)], new_world, 32, prompt_lengths=lengths)
    scratch = ordered_run(new_world)
    for a, b in zip(resumed, scratch):
        assert a.ledger.order == b.ledger.order and not a.ledger.dealt
        assert (a.ledger.num_consumed, a.ledger.next_in_order()) == (b.ledger.num_consumed, b.ledger.next_in_order())
        assert a.state_dict()["ledger"]["order"] is None
        a.ordered = True
        assert drain(a) == drain(b)


def test_a_state_saved_at_an_epoch_end_starts_the_next_epoch_at_the_new_size():
    ranks = pools(2, 12)
    for pool in ranks:
        drain(pool)
    resumed = resume([p.state_dict() for p in ranks], 3, 12)
    for p in resumed:
        assert p.ledger.epoch == 0 and p.ledger.epoch_done
        with pytest.raises(StopIteration):
            p.take(timeout=0)
        p.start_epoch(1)
        assert p.ledger.order == shard_indices(12, seed=3, epoch=1, rank=p.ledger.rank, world_size=3)


def test_a_rank_already_in_the_next_epoch_is_merged_with_one_that_finished_its_shard():
    """Shards of unequal size (no drop_remainder): one rank finished its shard and has not started epoch 1, the other
    is in epoch 1 already. Reconciled as epoch 1; a drift with prompts left in the older epoch is refused."""
    ranks = pools(2, 9)
    short = min(ranks, key=lambda p: p.ledger.shard_size)
    long = max(ranks, key=lambda p: p.ledger.shard_size)
    drain(short)
    short.start_epoch(1)
    first = train_after_grant(short, 2)
    drain(long)
    states = sorted((p.state_dict() for p in ranks), key=lambda s: s["ledger"]["rank"])
    (one,) = resume(states, 1, 9)
    assert one.ledger.epoch == 1
    assert sorted(first + drain(one)) == list(range(9))
    ranks = pools(2, 9)
    drain(ranks[0])
    ranks[0].start_epoch(1)
    with pytest.raises(ValueError, match="drifted apart"):
        resume([p.state_dict() for p in ranks], 1, 9)


def train_after_grant(pool: RolloutPool, n: int) -> list[int]:
    for lease in pool.grant("w", n, now=0.0):
        deliver(pool, lease)
    return train(pool, n)


def test_same_number_of_ranks_needs_no_reshard_and_another_dealing_does():
    ranks = pools(2, 10)
    states = [p.state_dict() for p in ranks]
    assert not needs_reshard(states, pools(2, 10, start=False)[0].ledger)
    assert needs_reshard(states, pools(1, 10, start=False)[0].ledger)
    assert needs_reshard(states, pools(2, 10, start=False, drop_remainder=True)[0].ledger)


@pytest.mark.parametrize("damage,why", [
    (lambda states: states[1]["ledger"].update(seed=9), "another dataset or seed"),
    (lambda states: [s["ledger"].update(num_prompts=11) for s in states], "another dataset or seed"),
    (lambda states: states[1].update(policy_version=5), "not one checkpoint"),
    (lambda states: states[0].update(timeline=[["run-b", 0]]), "not one checkpoint"),
    (lambda states: states.pop(), "every rank of one run"),
    (lambda states: states[0]["ready"].clear(), "damaged checkpoint"),
])
def test_what_cannot_be_reconciled_is_refused_with_the_reason(damage, why):
    ranks, _ = mid_epoch(2, 12)
    states = [p.state_dict() for p in ranks]
    damage(states)
    fresh = pools(3, 12, start=False)[0]
    with pytest.raises(ValueError, match=why):
        fresh.load_state_dict(reshard(states, fresh.ledger))
    assert not fresh.active
