"""Elastic resume: the pool states a run saved at M trainer ranks, continued at M′ ranks.

A checkpoint holds one pool state per rank. Resumed at the same number of ranks (and dealing settings), rank r
loads state r. At another number, every rank reads the states of all M ranks and :func:`reshard` makes the state of
its own rank of M′; every rank computes the same plan from the same inputs, nothing is exchanged::

    M saved states ──merge──► one epoch: prompts trained (∪), skipped (∪), groups buffered or delivered and
                              not yet trained (with their tensors), partial groups, failure counts, counters;
                              one policy version and one timeline (the same on every rank, or the states are
                              refused)
                   ──deal───► the epoch's prompts over M′ ranks as a run at M′ from scratch deals them
                              (:func:`~asyncrl.pool.shards.all_shards`, balanced by tokens), keeping the prompts the
                              epoch started with (drop_remainder at M′ neither adds nor drops any until the next
                              epoch); then, only if needed, the last prompts left of the fullest shards move to the
                              emptiest until the prompts left differ by at most one between ranks
                   ──route──► every buffered or delivered group and partial rollout to the rank that now
                              owns its prompt (trained there, not regenerated); every other prompt left is
                              generated there

What holds: each prompt of the epoch is trained once across the two parts (the trained ones are consumed on their
new rank, the rest are left to exactly one rank, the groups not yet trained move with their prompt); the policy
version and the timeline continue; the counters of saved rank r are added to new rank ``r % M′`` (their sums over
ranks are kept), plus ``resharded`` and ``rerouted_groups`` (groups that changed rank) in the pool's stats.

When the prompts trained before the save are the ones a run at M′ from scratch would have trained by then (ordered
delivery trains a prefix of the epoch's order; it is the same prefix when its length is a multiple of M′ per
window), the re-dealt shards, ledger positions and order of delivery are exactly that run's, so a synchronous
(``max_staleness=0``), ordered run with a deterministic engine continues batch for batch as the run at M′ from
scratch does from the same point. Otherwise the shards differ from it only by the balancing moves.

What is refused (``ValueError``, with the reason): another dataset size or seed (the epoch's order differs, so what
was trained cannot be told), a shard order the prompt lengths no longer give (another dataset of the same size),
states that are not one checkpoint of one run (policy versions or timelines differ, ranks missing), and ranks that
drifted a whole epoch apart with prompts left in the older one (shards of unequal size without drop_remainder).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.ledger import PromptLedger
from asyncrl.pool.shards import all_shards, deal, epoch_order, order_digest

__all__ = ["needs_reshard", "reshard"]


def needs_reshard(states: Sequence[Mapping[str, Any]], ledger: PromptLedger) -> bool:
    """True when the pool states of every saved rank cannot be loaded one per rank by ``ledger``'s run: they were saved
    at another number of ranks, or dealt with other ``shuffle`` / ``drop_remainder`` settings."""
    if len(states) != ledger.world_size:
        return True
    saved = states[0]["ledger"]
    return (saved.get("shuffle", ledger.shuffle), saved.get("drop_remainder", ledger.drop_remainder)) != (
        ledger.shuffle, ledger.drop_remainder)


@dataclass(slots=True)
class _Epoch:
    """The saved ranks' states merged into one epoch."""

    epoch: int
    prompts: set[int]
    """Every prompt the epoch started with (the saved shards together)."""
    consumed: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)
    buffered: set[int] = field(default_factory=set)
    """Buffered or delivered, not yet trained: their groups are in ``groups``."""
    retry: set[int] = field(default_factory=set)
    groups: dict[int, tuple[int, Any]] = field(default_factory=dict)
    """prompt -> (saved rank, wire group)."""
    partial: dict[int, list[Any]] = field(default_factory=lambda: collections.defaultdict(list))
    attempts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def done(self) -> set[int]:
        return self.consumed | self.skipped


def reshard(states: Sequence[Mapping[str, Any]], ledger: PromptLedger) -> dict[str, Any]:
    """The pool state rank ``ledger.rank`` of ``ledger.world_size`` loads, from the pool states of all saved ranks.

    Args:
        states: ``RolloutPool.state_dict()`` of every rank of the saved run, in rank order (tensors may be memory
            mapped: only the groups this rank now owns are read).
        ledger: this rank's (fresh) ledger: its rank, number of ranks, dataset size, seed and dealing settings.

    Returns:
        a pool state for ``RolloutPool.load_state_dict``, whose ledger state carries the re-dealt shard.

    Raises:
        ValueError: for states that cannot be reconciled with this run (see the module docstring), saying why.
    """
    _check_one_checkpoint(states, ledger)
    merged = _merge(states, ledger)
    world, rank = ledger.world_size, ledger.rank
    epoch = epoch_order(ledger.num_prompts, seed=ledger.seed, epoch=merged.epoch, shuffle=ledger.shuffle)
    kept = epoch[: len(epoch) - len(epoch) % world] if ledger.drop_remainder else epoch
    base = deal(kept, world, ledger.prompt_lengths)  # a run at M′ from scratch: shard_indices of every rank
    order = _plan(merged, epoch, base)[rank]
    owned = set(order)
    position = {idx: pos for pos, idx in enumerate(order)}
    consumed = {position[i] for i in owned & merged.consumed}
    watermark = 0
    while watermark in consumed:
        watermark += 1
    buffered = [i for i in order if i in merged.buffered]
    ledger_state = {
        "version": PromptLedger.STATE_VERSION, "epoch": merged.epoch, "num_prompts": ledger.num_prompts,
        "seed": ledger.seed, "rank": rank, "world_size": world, "shuffle": ledger.shuffle,
        "drop_remainder": ledger.drop_remainder, "order_digest": order_digest(order),
        "order": None if order == base[rank] else order, "cursor": 0,
        "retry": [i for i in order if i in merged.retry], "buffered": buffered, "watermark": watermark,
        "consumed_above": sorted(p for p in consumed if p > watermark),
        "attempts": {k: v for k, v in merged.attempts.items() if int(k) in owned},
        "failures": {k: v for k, v in merged.failures.items() if int(k) in owned},
        "skipped": [i for i in order if i in merged.skipped],
        "counters": _fold([s["ledger"].get("counters", {}) for s in states], rank, world),
    }
    stats = _fold([s.get("stats", {}) for s in states], rank, world)
    stats["resharded"] += 1
    stats["rerouted_groups"] += sum(merged.groups[i][0] != rank for i in buffered)
    first = states[0]
    return {
        "version": RolloutPool.STATE_VERSION, "group_size": first["group_size"],
        "policy_version": first["policy_version"], "timeline": first["timeline"], "ledger": ledger_state,
        "ready": [merged.groups[i][1] for i in buffered],
        "partial": [r for i in order if i not in merged.done for r in merged.partial.get(i, ())],
        "stats": dict(stats), "step_taken": 0,
    }


def _plan(merged: _Epoch, epoch: list[int], base: list[list[int]]) -> list[list[int]]:
    """Every new rank's shard of the merged epoch, each in the epoch's order (see the module docstring).

    Args:
        merged: the saved ranks' epoch.
        epoch: the epoch's global order.
        base: the shards a run at the new number of ranks deals from scratch.
    """
    world = len(base)
    pos = {idx: p for p, idx in enumerate(epoch)}
    done = merged.done
    shards = [[i for i in s if i in merged.prompts] for s in base]
    left = [[i for i in s if i not in done] for s in shards]
    finished = [[i for i in s if i in done] for s in shards]
    dealt = {i for s in shards for i in s}
    for idx in sorted(merged.prompts - dealt, key=pos.__getitem__):  # the epoch has them, M′'s deal drops them
        if idx in done:
            finished[min(range(world), key=lambda r: (len(finished[r]) + len(left[r]), r))].append(idx)
        else:
            bisect.insort(left[min(range(world), key=lambda r: (len(left[r]), r))], idx, key=pos.__getitem__)
    while True:  # only when what was trained is not a prefix of the order: balance what is left
        hi = max(range(world), key=lambda r: (len(left[r]), -r))
        lo = min(range(world), key=lambda r: (len(left[r]), r))
        if len(left[hi]) - len(left[lo]) <= 1:
            break
        bisect.insort(left[lo], left[hi].pop(), key=pos.__getitem__)
    return [sorted(finished[r] + left[r], key=pos.__getitem__) for r in range(world)]


def _check_one_checkpoint(states: Sequence[Mapping[str, Any]], ledger: PromptLedger) -> None:
    if not states:
        raise ValueError("no pool states to resume from: give the states of every rank of the saved run")
    for s in states:
        if s.get("version") != RolloutPool.STATE_VERSION:
            raise ValueError(f"pool state version {s.get('version')!r} != {RolloutPool.STATE_VERSION}")
        ledger.check_state(s["ledger"], same_topology=False)
    topology = [(s["ledger"]["rank"], s["ledger"]["world_size"]) for s in states]
    if topology != [(r, len(states)) for r in range(len(states))]:
        raise ValueError(f"the states must be those of every rank of one run, in rank order: got (rank, number of "
                         f"ranks) {topology}")
    for what in ("group_size", "policy_version", "timeline"):
        values = [s[what] for s in states]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"the saved ranks' states disagree on {what} ({values if what != 'timeline' else 'their segments'}): "
                "they are not one checkpoint of one run (every rank saves at the same step); resume from one "
                "checkpoint's files")


def _merge(states: Sequence[Mapping[str, Any]], ledger: PromptLedger) -> _Epoch:
    saved = [s["ledger"] for s in states]
    world = len(saved)
    epoch = max(s["epoch"] for s in saved)
    flags = {"shuffle": saved[0].get("shuffle", ledger.shuffle),
             "drop_remainder": saved[0].get("drop_remainder", ledger.drop_remainder)}
    shards: dict[int, list[list[int]]] = {}

    def shard_of(e: int, r: int) -> list[int]:
        if e not in shards:
            shards[e] = all_shards(ledger.num_prompts, seed=ledger.seed, epoch=e, world_size=world,
                                   prompt_lengths=ledger.prompt_lengths, **flags)
        return shards[e][r]

    merged = _Epoch(epoch=epoch, prompts=set())
    for r, (state, s) in enumerate(zip(states, saved)):
        order = list(s["order"]) if s.get("order") is not None else shard_of(s["epoch"], r)
        if s.get("order_digest") is not None and s["order_digest"] != order_digest(order):
            raise ValueError(
                f"rank {r}'s saved shard of epoch {s['epoch']} is not the one this run's prompt lengths deal "
                "(another dataset of the same size?): which prompts were trained cannot be told; resume with the "
                "run's dataset")
        consumed = {order[p] for p in range(s["watermark"])} | {order[p] for p in s["consumed_above"]}
        if s["epoch"] < epoch:  # a rank that finished its shard and has not started the next epoch yet
            if s["epoch"] != epoch - 1 or len(consumed) + len(s.get("skipped", ())) != len(order) or s["buffered"]:
                raise ValueError(
                    f"rank {r} saved epoch {s['epoch']} with {len(order) - len(consumed)} of its {len(order)} prompts "
                    f"not trained while another rank is already in epoch {epoch}: the ranks drifted apart (shards "
                    "of unequal size, drop_remainder=False), and one epoch at a time is re-dealt; resume at the "
                    f"same number of ranks ({world}), or train with drop_remainder=True")
            merged.prompts.update(shard_of(epoch, r))
            continue
        merged.prompts.update(order)
        merged.consumed |= consumed
        merged.skipped.update(s.get("skipped", ()))
        merged.buffered.update(s["buffered"])
        merged.retry.update(s["retry"])
        merged.attempts.update(s["attempts"])
        merged.failures.update(s.get("failures", {}))
        for g in state["ready"]:
            merged.groups[g["prompt_index"]] = (r, g)
        for rollout in state["partial"]:
            merged.partial[rollout["prompt_index"]].append(rollout)
    missing = sorted(merged.buffered - merged.groups.keys())
    if missing:
        raise ValueError(f"the saved states list prompts {missing[:10]} as buffered without their groups: a damaged "
                         "checkpoint; resume from another one")
    return merged


def _fold(counters: Sequence[Mapping[str, int]], rank: int, world: int) -> collections.Counter[str]:
    """The counters of the saved ranks ``r`` with ``r % world == rank`` added up (sums over all ranks are kept)."""
    out: collections.Counter[str] = collections.Counter()
    for r, c in enumerate(counters):
        if r % world == rank:
            out.update(c)
    return out
