"""Tests for asyncrl.pool.ledger: shard_indices and the PromptLedger lifecycle and state dict."""

from __future__ import annotations

import collections
import json

import pytest

from asyncrl.pool.ledger import PromptLedger, PromptState, shard_indices

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def all_shards(num_prompts: int, world_size: int, **kw) -> list[list[int]]:
    kw.setdefault("seed", 0)
    kw.setdefault("epoch", 0)
    return [shard_indices(num_prompts, rank=r, world_size=world_size, **kw) for r in range(world_size)]


def spread(shards: list[list[int]], lengths: list[int]) -> int:
    sums = [sum(lengths[i] for i in s) for s in shards]
    return max(sums) - min(sums)


def json_roundtrip(state: dict) -> dict:
    """Ledger state must survive a trip through JSON (it is stored in checkpoints)."""
    return json.loads(json.dumps(state))


def lease_all(ledger: PromptLedger, worker: str = "w", now: float = 0.0) -> list:
    out = []
    while (lease := ledger.lease(worker, now)) is not None:
        out.append(lease)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# shard_indices


def test_shard_indices_deterministic_for_seed_and_epoch():
    a = shard_indices(50, seed=7, epoch=3, rank=0, world_size=1)
    b = shard_indices(50, seed=7, epoch=3, rank=0, world_size=1)
    assert a == b
    assert sorted(a) == list(range(50))
    assert a != list(range(50))  # shuffled
    assert shard_indices(50, seed=7, epoch=4, rank=0, world_size=1) != a
    assert shard_indices(50, seed=8, epoch=3, rank=1, world_size=2) != shard_indices(
        50, seed=7, epoch=3, rank=1, world_size=2
    )


def test_shard_indices_differ_across_epochs_for_every_rank():
    for ws in (1, 2, 3):
        for r in range(ws):
            shards = [tuple(shard_indices(40, seed=0, epoch=e, rank=r, world_size=ws)) for e in range(4)]
            assert len(set(shards)) == 4, (ws, r)


def test_shard_indices_no_shuffle_is_striding():
    assert shard_indices(10, seed=0, epoch=5, rank=1, world_size=3, shuffle=False) == [1, 4, 7]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_prompts", [1, 3, 4, 7, 16, 33])
@pytest.mark.parametrize("balanced", [False, True])
def test_shards_disjoint_and_cover(world_size, num_prompts, balanced):
    lengths = [(i * 37) % 101 + 1 for i in range(num_prompts)] if balanced else None
    shards = all_shards(num_prompts, world_size, seed=3, epoch=1, prompt_lengths=lengths)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)), "shards overlap"
    assert sorted(flat) == list(range(num_prompts)), "shards do not cover the dataset"
    # sizes differ by at most one
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_prompts", [3, 4, 7, 16, 33])
@pytest.mark.parametrize("balanced", [False, True])
def test_shards_drop_remainder_equal_lengths(world_size, num_prompts, balanced):
    lengths = [(i * 37) % 101 + 1 for i in range(num_prompts)] if balanced else None
    shards = all_shards(num_prompts, world_size, seed=3, epoch=1, prompt_lengths=lengths, drop_remainder=True)
    sizes = {len(s) for s in shards}
    assert sizes == {num_prompts // world_size}
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == num_prompts - num_prompts % world_size
    # the skipped prompts are the tail of the global order
    order = shard_indices(num_prompts, seed=3, epoch=1, rank=0, world_size=1)
    assert set(range(num_prompts)) - set(flat) == set(order[len(flat) :])


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_prompt_lengths_balance_better_than_striding(world_size, shuffle):
    """A skewed length distribution where striding puts every long prompt on rank 0."""
    n = 12 * world_size
    order = shard_indices(n, seed=5, epoch=2, rank=0, world_size=1, shuffle=shuffle)
    lengths = [0] * n
    for pos, idx in enumerate(order):
        lengths[idx] = 1000 + pos if pos % world_size == 0 else 10 + pos % 7
    plain = all_shards(n, world_size, seed=5, epoch=2, shuffle=shuffle)
    balanced = all_shards(n, world_size, seed=5, epoch=2, shuffle=shuffle, prompt_lengths=lengths)
    assert plain[0] == order[0::world_size]  # sanity: striding gives rank 0 all the long ones
    s_plain, s_bal = spread(plain, lengths), spread(balanced, lengths)
    assert s_bal <= s_plain
    assert s_bal < s_plain / 4, (s_bal, s_plain)
    assert s_bal <= max(lengths)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("seed", range(8))
def test_prompt_lengths_spread_bounded_by_longest_prompt(world_size, seed):
    """Greedy longest-first per window keeps the token spread within one prompt length."""
    import random

    rng = random.Random(seed)
    n = 50 + seed
    lengths = [max(1, int(rng.lognormvariate(4, 1.2))) for _ in range(n)]
    balanced = all_shards(n, world_size, seed=seed, epoch=0, prompt_lengths=lengths, drop_remainder=True)
    assert spread(balanced, lengths) <= max(lengths)


def test_shard_indices_rank_out_of_range():
    with pytest.raises(ValueError):
        shard_indices(10, seed=0, epoch=0, rank=2, world_size=2)
    with pytest.raises(ValueError):
        shard_indices(10, seed=0, epoch=0, rank=-1, world_size=2)
    with pytest.raises(ValueError):
        shard_indices(10, seed=0, epoch=0, rank=0, world_size=0)


def test_shard_indices_prompt_lengths_wrong_size():
    with pytest.raises(ValueError):
        shard_indices(10, seed=0, epoch=0, rank=0, world_size=2, prompt_lengths=[1] * 9)


def test_ledger_rank_out_of_range():
    with pytest.raises(ValueError):
        PromptLedger(10, rank=3, world_size=2)


# ----------------------------------------------------------------------------------------------------------------------
# PromptLedger lifecycle


def test_lease_follows_order_and_states():
    ledger = PromptLedger(8, seed=1, rank=1, world_size=2)
    assert ledger.order == shard_indices(8, seed=1, epoch=0, rank=1, world_size=2)
    assert ledger.shard_size == 4
    other = [i for i in range(8) if i not in ledger.order]
    assert all(ledger.state_of(i) is None for i in other)
    assert all(ledger.state_of(i) is PromptState.PENDING for i in ledger.order)

    leases = lease_all(ledger, "w0", now=5.0)
    assert [l.prompt_index for l in leases] == ledger.order
    assert [l.attempt for l in leases] == [0] * 4
    assert len({l.lease_id for l in leases}) == 4
    assert all(l.epoch == 0 and l.worker_id == "w0" and l.deadline == 5.0 + ledger.lease_timeout_s for l in leases)
    assert ledger.lease("w0", 5.0) is None
    assert not ledger.has_pending()

    idx = ledger.order[0]
    assert ledger.state_of(idx) is PromptState.LEASED
    assert ledger.complete(0, idx, leases[0].lease_id) == (True, [])
    assert ledger.state_of(idx) is PromptState.BUFFERED
    assert leases[0].lease_id not in ledger.leases
    ledger.consume(idx)
    assert ledger.state_of(idx) is PromptState.CONSUMED
    assert ledger.num_consumed == 1
    assert ledger.counters["consumed"] == 1
    assert ledger.counters["leased"] == 4


def test_expire_requeues_and_reissues_first():
    ledger = PromptLedger(6, seed=0, lease_timeout_s=10.0)
    a = ledger.lease("w0", now=0.0)
    b = ledger.lease("w0", now=100.0)
    assert ledger.expire(now=9.99) == []
    expired = ledger.expire(now=10.0)
    assert [l.lease_id for l in expired] == [a.lease_id]
    assert ledger.state_of(a.prompt_index) is PromptState.PENDING
    assert ledger.state_of(b.prompt_index) is PromptState.LEASED
    assert ledger.counters["requeued_expired"] == 1
    assert ledger.counters["regenerated"] == 0

    again = ledger.lease("w1", now=20.0)
    assert again.prompt_index == a.prompt_index
    assert again.attempt == 1
    assert again.worker_id == "w1"
    assert again.lease_id != a.lease_id
    assert ledger.counters["regenerated"] == 1
    # then the order continues where it was
    assert ledger.lease("w1", now=20.0).prompt_index == ledger.order[2]


def test_release_worker_requeues_all_its_leases():
    ledger = PromptLedger(10, seed=2)
    l0 = ledger.lease("w0", 0.0)
    l1 = ledger.lease("w1", 0.0)
    l2 = ledger.lease("w0", 0.0)
    l3 = ledger.lease("w1", 0.0)
    gone = ledger.release_worker("w0")
    assert {l.lease_id for l in gone} == {l0.lease_id, l2.lease_id}
    assert set(ledger.leases) == {l1.lease_id, l3.lease_id}
    assert ledger.counters["requeued_worker_lost"] == 2
    again = [ledger.lease("w2", 1.0), ledger.lease("w2", 1.0)]
    assert [l.prompt_index for l in again] == [l0.prompt_index, l2.prompt_index]
    assert [l.attempt for l in again] == [1, 1]
    assert ledger.lease("w2", 1.0).prompt_index == ledger.order[4]
    assert ledger.release_worker("nobody") == []


def test_complete_duplicate_and_consumed():
    ledger = PromptLedger(4, seed=0)
    lease = ledger.lease("w", 0.0)
    assert ledger.complete(0, lease.prompt_index, lease.lease_id) == (True, [])
    assert ledger.complete(0, lease.prompt_index, lease.lease_id) == (False, [])
    assert ledger.complete(0, lease.prompt_index) == (False, [])
    ledger.consume(lease.prompt_index)
    assert ledger.complete(0, lease.prompt_index) == (False, [])
    assert ledger.state_of(lease.prompt_index) is PromptState.CONSUMED


def test_complete_cancels_other_leases_of_prompt():
    ledger = PromptLedger(4, seed=0, lease_timeout_s=10.0)
    first = ledger.lease("w0", 0.0)
    assert ledger.expire(10.0) == [first]
    second = ledger.lease("w1", 11.0)
    assert second.prompt_index == first.prompt_index
    # the (late) group of the first lease wins; the re-issue is void
    ok, cancelled = ledger.complete(0, first.prompt_index, first.lease_id)
    assert ok
    assert [l.lease_id for l in cancelled] == [second.lease_id]
    assert cancelled[0].worker_id == "w1"
    assert second.lease_id not in ledger.leases
    assert ledger.state_of(first.prompt_index) is PromptState.BUFFERED


def test_complete_through_live_lease_cancels_nothing():
    ledger = PromptLedger(4, seed=0)
    lease = ledger.lease("w0", 0.0)
    assert ledger.complete(0, lease.prompt_index, lease.lease_id) == (True, [])
    lease2 = ledger.lease("w0", 0.0)
    # a group arriving without a known lease id cancels the lease
    ok, cancelled = ledger.complete(0, lease2.prompt_index, None)
    assert ok and [l.lease_id for l in cancelled] == [lease2.lease_id]


def test_complete_wrong_epoch_or_shard_rejected():
    ledger = PromptLedger(8, seed=0, rank=0, world_size=2)
    lease = ledger.lease("w", 0.0)
    assert ledger.complete(1, lease.prompt_index, lease.lease_id) == (False, [])
    assert ledger.state_of(lease.prompt_index) is PromptState.LEASED
    assert lease.lease_id in ledger.leases
    not_mine = next(i for i in range(8) if i not in ledger.order)
    assert ledger.complete(0, not_mine) == (False, [])


def test_requeue_stale_sends_buffered_prompt_back():
    ledger = PromptLedger(5, seed=0)
    lease = ledger.lease("w", 0.0)
    ledger.complete(0, lease.prompt_index, lease.lease_id)
    ledger.requeue_stale(lease.prompt_index)
    assert ledger.state_of(lease.prompt_index) is PromptState.PENDING
    assert ledger.counters["requeued_stale"] == 1
    again = ledger.lease("w", 1.0)
    assert again.prompt_index == lease.prompt_index and again.attempt == 1
    assert ledger.counters["regenerated"] == 1


def test_consume_requires_buffered():
    ledger = PromptLedger(5, seed=0)
    idx = ledger.order[0]
    with pytest.raises(RuntimeError):
        ledger.consume(idx)  # pending
    lease = ledger.lease("w", 0.0)
    with pytest.raises(RuntimeError):
        ledger.consume(lease.prompt_index)  # leased
    ledger.complete(0, lease.prompt_index, lease.lease_id)
    ledger.consume(lease.prompt_index)
    with pytest.raises(RuntimeError):
        ledger.consume(lease.prompt_index)  # consumed


def test_consume_out_of_order_watermark_and_epoch_done():
    ledger = PromptLedger(6, seed=4)
    leases = lease_all(ledger)
    for l in leases:
        ledger.complete(0, l.prompt_index, l.lease_id)
    order = ledger.order
    assert ledger.num_consumed == 0 and not ledger.epoch_done

    ledger.consume(order[2])
    ledger.consume(order[4])
    assert ledger.num_consumed == 2
    st = ledger.state_dict()
    assert st["watermark"] == 0 and st["consumed_above"] == [2, 4]

    ledger.consume(order[0])
    st = ledger.state_dict()
    assert ledger.num_consumed == 3 and st["watermark"] == 1 and st["consumed_above"] == [2, 4]

    ledger.consume(order[1])
    st = ledger.state_dict()
    assert ledger.num_consumed == 4 and st["watermark"] == 3 and st["consumed_above"] == [4]
    assert not ledger.epoch_done

    ledger.consume(order[5])
    ledger.consume(order[3])
    st = ledger.state_dict()
    assert ledger.num_consumed == 6 and st["watermark"] == 6 and st["consumed_above"] == []
    assert ledger.epoch_done
    assert all(ledger.state_of(i) is PromptState.CONSUMED for i in order)


def test_start_epoch_resets_everything():
    ledger = PromptLedger(6, seed=4)
    l = ledger.lease("w", 0.0)
    ledger.complete(0, l.prompt_index, l.lease_id)
    ledger.consume(l.prompt_index)
    ledger.lease("w", 0.0)
    old_order = ledger.order
    ledger.start_epoch(1)
    assert ledger.epoch == 1
    assert ledger.order != old_order
    assert ledger.leases == {} and ledger.num_consumed == 0
    assert [x.prompt_index for x in lease_all(ledger)] == ledger.order


def test_empty_shard_is_done_immediately():
    ledger = PromptLedger(3, rank=3, world_size=4)
    assert ledger.shard_size == 0
    assert ledger.epoch_done
    assert ledger.lease("w", 0.0) is None


def test_lease_skips_prompt_completed_ahead_of_cursor():
    ledger = PromptLedger(5, seed=0)
    ahead = ledger.order[-1]
    assert ledger.complete(0, ahead) == (True, [])  # a group for a never-leased prompt is accepted
    leases = lease_all(ledger)
    assert ahead not in [l.prompt_index for l in leases], "a buffered prompt was leased for generation again"


# ----------------------------------------------------------------------------------------------------------------------
# state dict


def _mid_epoch_ledger() -> tuple[PromptLedger, dict]:
    """10 prompts: 6 leased; o1 failed (retry), o0/o3 buffered, o3 consumed; o2/o4/o5 outstanding."""
    ledger = PromptLedger(10, seed=11, lease_timeout_s=50.0)
    o = ledger.order
    leases = {l.prompt_index: l for l in (ledger.lease(f"w{i % 2}", 0.0) for i in range(6))}
    assert list(leases) == o[:6]
    ledger.release(leases[o[1]].lease_id, "failed")
    for i in (0, 3):
        assert ledger.complete(0, o[i], leases[o[i]].lease_id)[0]
    ledger.consume(o[3])
    info = {"outstanding": [o[2], o[4], o[5]], "retry": [o[1]], "buffered": [o[0]], "consumed": [o[3]]}
    return ledger, info


def test_state_dict_roundtrip_into_new_ledger():
    old, info = _mid_epoch_ledger()
    o = old.order
    state = json_roundtrip(old.state_dict())
    assert state["retry"][:3] == info["outstanding"]  # outstanding leases first, in order
    assert set(state["retry"]) == set(info["outstanding"] + info["retry"])

    new = PromptLedger(10, seed=11, lease_timeout_s=50.0)
    new.load_state_dict(state)
    assert new.epoch == old.epoch and new.order == o
    assert new.leases == {}
    assert new.num_consumed == 1
    for i in info["outstanding"] + info["retry"]:
        assert new.state_of(i) is PromptState.PENDING
    for i in info["buffered"]:
        assert new.state_of(i) is PromptState.BUFFERED
    for i in info["consumed"]:
        assert new.state_of(i) is PromptState.CONSUMED
    assert new.counters == old.counters

    # prompts to regenerate come first (outstanding in order), then the cursor continues
    first = [new.lease("x", 0.0) for _ in range(4)]
    got = [l.prompt_index for l in first]
    assert set(got) == set(info["outstanding"] + info["retry"])
    assert [i for i in got if i in info["outstanding"]] == info["outstanding"]
    assert all(l.attempt == 1 for l in first)
    rest = lease_all(new, "x")
    assert [l.prompt_index for l in rest] == o[6:]
    assert all(l.attempt == 0 for l in rest)

    consumed = collections.Counter(info["consumed"])
    for l in first + rest:
        assert new.complete(0, l.prompt_index, l.lease_id) == (True, [])
    for i in o:
        if new.state_of(i) is PromptState.BUFFERED:
            new.consume(i)
            consumed[i] += 1
    assert new.epoch_done
    assert sorted(consumed) == sorted(o) and set(consumed.values()) == {1}


def test_state_dict_roundtrip_in_later_epoch():
    old = PromptLedger(7, seed=3)
    old.start_epoch(2)
    l = old.lease("w", 0.0)
    state = json_roundtrip(old.state_dict())
    new = PromptLedger(7, seed=3)
    new.load_state_dict(state)
    assert new.epoch == 2 and new.order == old.order
    assert new.lease("w", 0.0).prompt_index == l.prompt_index


def test_state_dict_roundtrip_done_epoch():
    old = PromptLedger(3, seed=3)
    for l in lease_all(old):
        old.complete(0, l.prompt_index, l.lease_id)
        old.consume(l.prompt_index)
    new = PromptLedger(3, seed=3)
    new.load_state_dict(json_roundtrip(old.state_dict()))
    assert new.epoch_done and new.lease("w", 0.0) is None


@pytest.mark.parametrize(
    "kwargs,saved,now,why",
    [
        (dict(num_prompts=11), "10 prompts with seed 11", "11 prompts and seed 11", "another dataset or seed"),
        (dict(seed=12), "10 prompts with seed 11", "10 prompts and seed 12", "another dataset or seed"),
        (dict(rank=1, world_size=2), "rank 0's of a run at 1 trainer ranks", "rank 1 of 2", "states of all 1 ranks"),
        (dict(world_size=2), "rank 0's of a run at 1 trainer ranks", "rank 0 of 2", "states of all 1 ranks"),
        (dict(shuffle=False), "shuffle=True", "shuffle=False, drop_remainder=False now", "cannot be told"),
    ],
)
def test_load_state_dict_rejects_mismatch(kwargs, saved, now, why):
    """Refused with what the state was saved with, what this run has and why; the ledger is left untouched (a resume
    at another number of ranks goes through asyncrl.pool.reshard with every rank's state: tests/unit/pool/test_reshard.py)."""
    old, _ = _mid_epoch_ledger()
    state = old.state_dict()
    params = dict(num_prompts=10, seed=11, rank=0, world_size=1)
    params.update(kwargs)
    new = PromptLedger(params.pop("num_prompts"), **params)
    before = (new.order, dict(new.leases))
    with pytest.raises(ValueError) as exc:
        new.load_state_dict(state)
    msg = str(exc.value)
    assert saved in msg and now in msg and why in msg, msg
    assert (new.order, dict(new.leases)) == before  # untouched


def test_a_shard_the_prompt_lengths_no_longer_give_is_refused():
    """Another dataset of the same size with other prompt lengths deals other shards: the saved positions would mark
    other prompts as trained."""
    lengths = [1, 9, 2, 8, 3, 7, 4, 6, 5, 5]
    old = PromptLedger(10, seed=1, rank=0, world_size=2, prompt_lengths=lengths)
    lease_all(old)
    state = old.state_dict()
    other = PromptLedger(10, seed=1, rank=0, world_size=2, prompt_lengths=lengths[::-1])
    assert other.order != old.order
    with pytest.raises(ValueError, match="another order of its shard .* other prompt lengths"):
        other.load_state_dict(state)
    same = PromptLedger(10, seed=1, rank=0, world_size=2, prompt_lengths=lengths)
    same.load_state_dict(state)
    assert same.order == old.order


def test_a_version_1_state_still_loads():
    old, info = _mid_epoch_ledger()
    state = old.state_dict()
    for key in ("shuffle", "drop_remainder", "order_digest", "order"):
        del state[key]
    state["version"] = 1
    new = PromptLedger(10, seed=11)
    new.load_state_dict(state)
    assert new.order == old.order and new.num_consumed == 1


def test_load_state_dict_rejects_other_version():
    old, _ = _mid_epoch_ledger()
    state = old.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="version"):
        PromptLedger(10, seed=11).load_state_dict(state)
