"""Poisoned prompts (asyncrl.pool.poison): failed attempts counted per prompt in the ledger, re-issue backoff,
and the pool's raise / skip policies, with exactly-once accounting that tells skipped from consumed."""

from __future__ import annotations

import math

import pytest

from asyncrl.codec import decode, dumps_json, encode, loads_json
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger, PromptState
from asyncrl.pool.poison import PoisonedPromptError, reissue_backoff_s
from tests.unit.pool.test_pool import deliver, make_group

ERROR = "ValueError: an engine needs a prompt with 'prompt_ids' or 'text', got {'foo': 1}"


def make_pool(num_prompts: int = 6, **kw) -> RolloutPool:
    ledger = PromptLedger(num_prompts, seed=0)
    kw.setdefault("failure_backoff_s", 0.0)
    pool = RolloutPool(ledger, group_size=2, capacity=num_prompts, **kw)
    pool.start_epoch(0)
    return pool


def fail_until_poisoned(pool: RolloutPool, poisoned: int, limit: int, now: float = 0.0) -> list[int]:
    """Leases and fails ``poisoned`` ``limit`` times (delivering every other prompt it is leased with)."""
    counts = []
    for _ in range(limit):
        now += 100.0  # past any backoff
        leases = pool.grant("w", 100, now=now)
        for lease in leases:
            if lease.prompt_index == poisoned:
                counts.append(pool.lease_failed(lease.lease_id, "w", ERROR, now=now))
            else:
                deliver(pool, lease)
    return counts


def consume_all(pool: RolloutPool) -> list[int]:
    """Takes (and commits) every ready group until StopIteration; returns the prompts consumed."""
    out = []
    while True:
        group = pool.take(timeout=0)
        if group is None:
            return out
        pool.commit(group.epoch, [group.prompt_index])
        out.append(group.prompt_index)


# -- ledger ------------------------------------------------------------------------------------------------------------


def test_ledger_counts_failed_attempts_with_the_last_error_and_backs_off():
    ledger = PromptLedger(4, seed=0, shuffle=False)
    lease = ledger.lease("w", now=0.0)
    assert ledger.record_failure(lease.lease_id, "boom 1", now=0.0, backoff_s=1.0) == 1
    assert ledger.failures_of(0) == (1, "boom 1")
    assert ledger.state_of(0) is PromptState.PENDING
    # backing off: the failed prompt is not re-issued at once; the next prompt is
    assert ledger.lease("w", now=0.5).prompt_index == 1
    again = ledger.lease("w", now=1.0)
    assert again.prompt_index == 0 and again.attempt == 1
    assert ledger.record_failure(again.lease_id, "boom 2", now=1.0, backoff_s=1.0) == 2
    assert ledger.failures_of(0) == (2, "boom 2")
    assert ledger.lease("w", now=2.9).prompt_index == 2  # second backoff is 2 s
    assert ledger.lease("w", now=3.0).prompt_index == 0
    # a report for a lease that is not live (already failed) counts for nothing
    assert ledger.record_failure(again.lease_id, "late", now=3.0) is None
    assert ledger.failures_of(0)[0] == 2 and ledger.counters["lease_failures"] == 2


def test_reissue_backoff_doubles_and_is_capped():
    assert [reissue_backoff_s(n, 0.5) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert reissue_backoff_s(50, 0.5) == 30.0 and reissue_backoff_s(3, 0.0) == 0.0


def test_failures_and_skips_survive_a_state_dict_roundtrip_through_json():
    ledger = PromptLedger(4, seed=0, shuffle=False)
    a, b = ledger.lease("w", 0.0), ledger.lease("w", 0.0)
    ledger.record_failure(a.lease_id, "boom", now=0.0, backoff_s=5.0)
    ledger.record_failure(b.lease_id, "bang", now=0.0)
    ledger.skip(1)
    state = loads_json(dumps_json(ledger.state_dict()))
    new = PromptLedger(4, seed=0, shuffle=False)
    new.load_state_dict(state)
    assert new.failures_of(0) == (1, "boom") and new.failures_of(1) == (1, "bang")
    assert new.state_of(1) is PromptState.SKIPPED and new.skipped == [1]
    # the backed-off prompt is saved as one to re-issue (at once after a resume)
    assert new.lease("w", 0.0).prompt_index == 0
    assert new.num_consumed == 0


def test_skipped_prompt_is_done_for_the_epoch_but_never_consumed():
    ledger = PromptLedger(3, seed=0, shuffle=False)
    leases = [ledger.lease("w", 0.0) for _ in range(3)]
    assert [lease.lease_id for lease in ledger.skip(1)] == [leases[1].lease_id]
    for lease in (leases[0], leases[2]):
        ledger.complete(0, lease.prompt_index, lease.lease_id)
        ledger.deliver(lease.prompt_index)
        ledger.consume(lease.prompt_index)
    assert ledger.epoch_done and ledger.num_consumed == 2 and ledger.skipped == [1]
    assert ledger.next_in_order() is None  # ordered delivery does not wait for a skipped prompt
    assert ledger.complete(0, 1) == (False, [])  # a late group for it is not accepted
    with pytest.raises(RuntimeError, match="SKIPPED|skipped"):
        ledger.skip(1)


# -- pool --------------------------------------------------------------------------------------------------------------


def test_raise_mode_names_the_prompt_the_count_and_the_error():
    pool = make_pool(max_prompt_failures=3, on_poisoned_prompt="raise")
    poisoned = pool.ledger.order[2]
    assert fail_until_poisoned(pool, poisoned, 3) == [1, 2, 3]
    with pytest.raises(PoisonedPromptError) as info:
        consume_all(pool)
    e = info.value
    assert (e.epoch, e.prompt_index, e.failures, e.error) == (0, poisoned, 3, ERROR)
    assert f"index={poisoned}" in str(e) and "3 times" in str(e) and "{'foo': 1}" in str(e)
    # parked: it is not leased again (no worker spins on it) and take keeps raising
    assert all(lease.prompt_index != poisoned for lease in pool.grant("w", 100, now=1e6))
    with pytest.raises(PoisonedPromptError):
        pool.take(timeout=0)


def test_raise_mode_raises_even_while_other_groups_are_ready():
    pool = make_pool(max_prompt_failures=1)
    leases = pool.grant("w", 100, now=0.0)
    deliver(pool, leases[0])
    pool.lease_failed(leases[1].lease_id, "w", ERROR, now=0.0)
    with pytest.raises(PoisonedPromptError, match=f"index={leases[1].prompt_index}"):
        pool.take(timeout=0)


def test_skip_mode_ends_the_epoch_with_every_other_group_consumed_exactly_once():
    pool = make_pool(max_prompt_failures=3, on_poisoned_prompt="skip")
    poisoned = pool.ledger.order[0]
    fail_until_poisoned(pool, poisoned, 3)
    consumed = []
    with pytest.raises(StopIteration):
        while True:
            group = pool.take(timeout=0)
            assert group is not None, "the epoch must end: nothing is left but the skipped prompt"
            pool.commit(group.epoch, [group.prompt_index])
            consumed.append(group.prompt_index)
    assert sorted(consumed) == sorted(set(pool.ledger.order) - {poisoned})
    assert pool.stats["skipped_poisoned"] == 1 and pool.ledger.skipped == [poisoned]
    assert pool.ledger.state_of(poisoned) is PromptState.SKIPPED and pool.ledger.num_consumed == 5


def test_skip_mode_refuses_a_late_group_for_the_skipped_prompt():
    pool = make_pool(max_prompt_failures=1, on_poisoned_prompt="skip")
    lease_a = pool.grant("a", 1, now=0.0)[0]
    pool.expire(now=1e9)  # a's lease expires; the prompt goes to b
    lease_b = pool.grant("b", 1, now=1e9)[0]
    assert lease_b.prompt_index == lease_a.prompt_index
    pool.lease_failed(lease_b.lease_id, "b", ERROR, now=1e9)
    late = make_group(0, lease_a.prompt_index, 2, 0, worker_id="a")  # a finishes after all
    assert pool.add_rollouts(late.rollouts, lease_id=lease_a.lease_id) == 0
    assert pool.stats["skipped_prompt"] == 2


def test_a_report_from_a_worker_that_does_not_hold_the_lease_counts_for_nothing():
    pool = make_pool(max_prompt_failures=1)
    lease = pool.grant("w", 1, now=0.0)[0]
    assert pool.lease_failed(lease.lease_id, "intruder", ERROR) is None
    assert pool.lease_failed(12345, "w", ERROR) is None
    assert pool.ledger.failures_of(lease.prompt_index) == (0, "")
    assert pool.take(timeout=0) is None  # nothing poisoned


def test_a_prompt_that_succeeds_after_failing_is_not_poisoned():
    pool = make_pool(max_prompt_failures=3, failure_backoff_s=0.5)
    lease = pool.grant("w", 1, now=0.0)[0]
    pool.lease_failed(lease.lease_id, "w", ERROR, now=0.0)
    pool.lease_failed(pool.grant("w", 1, now=0.0)[0].lease_id, "w", ERROR, now=0.0)  # next prompt, not backed off
    retry = [x for x in pool.grant("w", 100, now=10.0) if x.prompt_index == lease.prompt_index]
    assert retry and retry[0].attempt == 1
    deliver(pool, retry[0])
    assert pool.take(timeout=0).prompt_index == lease.prompt_index


def test_failure_count_kept_across_resume_poisons_on_the_next_failure():
    pool = make_pool(max_prompt_failures=3)
    poisoned = pool.ledger.order[1]
    fail_until_poisoned(pool, poisoned, 2)
    _, state = decode([bytes(f) for f in encode("state", pool.state_dict())])  # as a checkpoint stores it
    resumed = RolloutPool(PromptLedger(6, seed=0), group_size=2, capacity=6, max_prompt_failures=3,
                          failure_backoff_s=0.0)
    resumed.load_state_dict(state)
    assert resumed.ledger.failures_of(poisoned) == (2, ERROR)
    lease = next(x for x in resumed.grant("w", 100, now=0.0) if x.prompt_index == poisoned)
    assert resumed.lease_failed(lease.lease_id, "w", ERROR) == 3
    with pytest.raises(PoisonedPromptError, match="3 times"):
        resumed.take(timeout=0)


def test_poisoned_prompt_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(PoisonedPromptError(1, 7, 3, "boom")))
    assert (e.epoch, e.prompt_index, e.failures, e.error) == (1, 7, 3, "boom") and "index=7" in str(e)


def test_constructor_validates_the_poison_settings():
    with pytest.raises(ValueError, match="max_prompt_failures"):
        make_pool(max_prompt_failures=0)
    with pytest.raises(ValueError, match="on_poisoned_prompt"):
        make_pool(on_poisoned_prompt="ignore")
    assert not math.isinf(reissue_backoff_s(10, 1e9))
