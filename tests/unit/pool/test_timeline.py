"""One timeline and acknowledged consumption at the pool: the breaks of issue 10 (items 1 and 5) in-process.

* a rollout newer than the trainer, or from a rolled-back incarnation, is never trained (it was: a worker
  that loaded the dead run's version 20 delivered batches consumed at staleness -2 after a resume at 18);
* a group counts as consumed when the update it fed is committed, so a checkpoint taken while a batch is
  prefetched re-delivers it (a prefetching consumer lost 8 groups per resume), and staleness is judged at
  the version the group is trained at.
"""

from __future__ import annotations

import pytest

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger, PromptState
from asyncrl.pool.timeline import Timeline, new_incarnation
from tests.unit.pool.test_pool import make_group


def make_pool(incarnation: str, *, max_staleness: int | None = 1, prefetch: int = 0, num_prompts: int = 8) -> RolloutPool:
    pool = RolloutPool(PromptLedger(num_prompts, seed=0), group_size=2, capacity=8, max_staleness=max_staleness,
                       prefetch=prefetch, incarnation=incarnation)
    pool.start_epoch(0)
    return pool


def send(pool: RolloutPool, lease, version: int, incarnation: str) -> int:
    group = make_group(lease.epoch, lease.prompt_index, pool.group_size, version, worker_id=lease.worker_id)
    for r in group.rollouts:
        r.incarnation = incarnation
    return pool.add_rollouts(group.rollouts, lease_id=lease.lease_id)


def test_timeline_segments_cover_the_history_up_to_each_fork():
    t = Timeline("a")
    assert t.check("a", 5, 5) is None and t.check("a", 6, 5) == "ahead_of_trainer"
    t.continue_as("b", 18)  # b resumed from a's checkpoint of version 18
    assert t.check("a", 18, 25) is None, "the resumed checkpoint is a's version 18: same weights"
    assert t.check("a", 19, 25) == "dead_timeline" and t.check("a", 20, 25) == "dead_timeline"
    assert t.check("b", 20, 25) is None and t.check("b", 17, 25) == "dead_timeline"
    assert t.check("zzz", 3, 25) == "dead_timeline"
    assert t.check("", 3, 25) is None, "no incarnation: an engine without weight sync, judged by version alone"
    restored = Timeline("c")
    restored.load_state_dict(t.state_dict(), live="c", version=22)
    assert restored.segments == [("a", 0), ("b", 18), ("c", 22)]
    with pytest.raises(ValueError, match="timeline state"):
        restored.load_state_dict([["a", "x"]], live="c", version=1)
    assert len(new_incarnation()) == 16 and new_incarnation() != new_incarnation()


def test_rollouts_ahead_of_the_trainer_are_refused_and_regenerated():
    pool = make_pool("live")
    pool.set_policy_version(3)
    (lease,) = pool.grant("w0", 1, now=0.0)
    assert send(pool, lease, version=10**9, incarnation="live") == 0
    assert pool.stats["ahead_of_trainer"] == 2
    assert pool.ledger.state_of(lease.prompt_index) is PromptState.LEASED  # the receiver releases it: regenerated
    assert send(pool, lease, version=3, incarnation="live") == 2
    assert pool.take(0).policy_version == 3


def test_a_resumed_pool_refuses_the_dead_timeline_after_the_fork():
    """Trainer incarnation 'dead' reached version 20 after checkpointing at 18, crashed, and 'live' resumed
    from the checkpoint: a worker still on dead's version 20 (or 19) is refused; dead's 18 is the same weights."""
    dead = make_pool("dead", max_staleness=4)
    dead.set_policy_version(18)
    state = dead.state_dict()
    live = RolloutPool(PromptLedger(8, seed=0), group_size=2, capacity=8, max_staleness=4, incarnation="live")
    live.load_state_dict(state)
    assert live.timeline.segments == [("dead", 0), ("live", 18)]
    leases = live.grant("w0", 4, now=0.0)
    assert send(live, leases[0], version=18, incarnation="live") == 2  # v18 published by the live run
    assert send(live, leases[1], version=18, incarnation="dead") == 2  # the checkpointed weights themselves
    live.set_policy_version(20)
    assert send(live, leases[2], version=20, incarnation="dead") == 0
    assert send(live, leases[3], version=19, incarnation="dead") == 0
    assert live.stats["dead_timeline"] == 4
    # the live run's own version 20 is fine
    assert send(live, leases[2], version=20, incarnation="live") == 2
    assert live.stats["groups_received"] == 3


def test_a_span_newer_than_the_trainer_is_refused():
    pool = make_pool("live")
    pool.set_policy_version(1)
    (lease,) = pool.grant("w0", 1, now=0.0)
    group = make_group(lease.epoch, lease.prompt_index, 2, 1, worker_id="w0")
    for r in group.rollouts:
        n = int(r.response_ids.numel())
        r.incarnation, r.version_spans = "live", [(1, 0, 1), (5, 1, n)]
    assert pool.add_rollouts(group.rollouts, lease_id=lease.lease_id) == 0
    assert pool.stats["ahead_of_trainer"] == 2


def test_a_delivered_group_is_consumed_only_when_committed_and_is_redelivered_after_resume():
    pool = make_pool("a", num_prompts=2)
    leases = pool.grant("w0", 2, now=0.0)
    for lease in leases:
        send(pool, lease, 0, "a")
    first = pool.take(0)  # trained, then its update committed
    second = pool.take(0)  # prefetched: not trained when the checkpoint is taken
    assert pool.ledger.state_of(first.prompt_index) is PromptState.DELIVERED
    assert pool.commit(0, [first.prompt_index]) == 1
    assert pool.ledger.state_of(first.prompt_index) is PromptState.CONSUMED
    assert not pool.ledger.epoch_done and pool.ledger.all_delivered
    with pytest.raises(StopIteration):
        pool.take(0)  # nothing left to yield, even though `second` is not committed yet
    state = pool.state_dict()
    resumed = RolloutPool(PromptLedger(2, seed=0), group_size=2, capacity=8, max_staleness=1, incarnation="b")
    resumed.load_state_dict(state)
    again = resumed.take(0)
    assert again.prompt_index == second.prompt_index, "the prefetched group is delivered again after resume"
    assert resumed.ledger.state_of(first.prompt_index) is PromptState.CONSUMED
    assert resumed.commit(0, [again.prompt_index]) == 1 and resumed.ledger.epoch_done
    assert resumed.commit(0, [again.prompt_index]) == 0 and resumed.stats["commit_ignored"] == 1


def test_a_commit_from_before_a_reset_is_void():
    pool = make_pool("a", num_prompts=2)
    (lease,) = pool.grant("w0", 1, now=0.0)
    send(pool, lease, 0, "a")
    generation = pool.min_lease_id
    g = pool.take(0)
    pool.load_state_dict(pool.state_dict())  # e.g. the loader's load_state_dict in the same process
    assert pool.commit(0, [g.prompt_index], generation=generation) == 0
    assert pool.ledger.state_of(g.prompt_index) is PromptState.BUFFERED  # still to be delivered (again)


def test_prefetch_judges_staleness_at_the_training_version():
    """A consumer one batch ahead trains a group taken at version v at v + 1: with max_staleness=1 a group
    of v - 1 taken at v would be trained at staleness 2 (seen with Lightning), so it is dropped."""
    pool = make_pool("a", max_staleness=1, prefetch=1)
    leases = pool.grant("w0", 2, now=0.0)
    send(pool, leases[0], 0, "a")
    pool.set_policy_version(1)
    send(pool, leases[1], 1, "a")
    assert pool.take(0).prompt_index == leases[1].prompt_index  # version 1 trained at 2: staleness 1
    assert pool.stats["stale_dropped"] == 1  # version 0 would be trained at 2
    with pytest.raises(ValueError, match="prefetch"):
        make_pool("a", max_staleness=0, prefetch=1)


def test_ordered_delivery_moves_past_delivered_uncommitted_groups():
    """Ordered mode once waited forever on the head of the order after yielding it (delivered is not consumed):
    the recipe's reproducible regime stalled on its first batch."""
    pool = RolloutPool(PromptLedger(6, seed=0), group_size=2, capacity=6, ordered=True, incarnation="a")
    pool.start_epoch(0)
    leases = pool.grant("w0", 6, now=0.0)
    for lease in reversed(leases):
        send(pool, lease, 0, "a")
    got = [pool.take(0.01).prompt_index for _ in range(6)]  # none committed yet
    assert got == pool.ledger.order
    with pytest.raises(StopIteration):
        pool.take(0)


def test_a_late_copy_of_a_delivered_group_is_a_duplicate():
    """A copy arriving while its prompt is delivered but not committed once passed the duplicate check and
    tripped 'completed twice' in the receiver thread (found by the over-the-wire rollback test)."""
    pool = make_pool("a", num_prompts=2)
    leases = pool.grant("w0", 1, now=0.0)
    send(pool, leases[0], 0, "a")
    g = pool.take(0)
    assert send(pool, leases[0], 0, "a") == 0
    assert pool.stats["duplicate"] == 2 and pool.ledger.state_of(g.prompt_index) is PromptState.DELIVERED
