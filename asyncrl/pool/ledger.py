"""The prompt ledger: where every prompt of this rank's shard of the epoch is.

Lifecycle of one prompt (per epoch)::

    PENDING ──lease──► LEASED ──group arrives──► BUFFERED ──yielded──► DELIVERED ──update committed──► CONSUMED
       ▲                 │                           │                     │
       └──── expired / worker lost / failed ─────────┘ stale               └─ saved as BUFFERED: a checkpoint
                                                       (max_staleness)        re-delivers it after resume

A group counts as consumed when the trainer commits the update it fed, not when it is yielded, so a
consumer that prefetches (Lightning, a prefetch thread) loses nothing across a checkpoint.

A lease that comes back FAILED (the worker's engine or reward raised) counts against its prompt;
the prompt is re-issued after a doubling backoff. A prompt that failed ``max_prompt_failures``
times is poisoned (:mod:`asyncrl.pool.poison`): parked (PENDING, never re-issued until a resume) while
the pool raises, or ``LEASED/PENDING ──skip──► SKIPPED``: done for the epoch, never consumed.

The ledger is like ``DistributedSampler`` plus DataLoader worker sharding, but dynamic: the order of
prompts is a deterministic function of ``(seed, epoch)``, this rank owns a fixed shard of it, and
prompts are handed to whichever worker asks, as leases with deadlines. A lease whose worker dies or
misses its deadline goes back to the front of the queue; the first complete group to arrive for a
prompt wins and any other copy is a counted duplicate. Consumption is recorded as a watermark over
the shard's order plus the set of positions consumed above it, so the state stays small.

The ledger is not thread-safe: :class:`~asyncrl.pool.buffer.RolloutPool` owns it and holds its lock.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from asyncrl.pool.poison import reissue_backoff_s

__all__ = ["Lease", "PromptLedger", "PromptState", "shard_indices"]


class PromptState(str, Enum):
    PENDING = "pending"
    LEASED = "leased"
    BUFFERED = "buffered"
    DELIVERED = "delivered"
    CONSUMED = "consumed"
    SKIPPED = "skipped"
    """Poisoned and skipped (``loader.on_poisoned_prompt='skip'``): done for the epoch, never consumed."""


@dataclass(slots=True)
class Lease:
    """A prompt handed to a worker until ``deadline`` (monotonic seconds)."""

    lease_id: int
    epoch: int
    prompt_index: int
    worker_id: str
    deadline: float
    attempt: int
    """0 for the first issue of this prompt in this epoch, +1 per re-issue."""


def shard_indices(
    num_prompts: int,
    *,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    prompt_lengths: Sequence[int] | None = None,
    drop_remainder: bool = False,
) -> list[int]:
    """This rank's prompts for ``epoch``, in the order they are leased.

    The global order is ``torch.randperm`` seeded with ``seed + epoch`` (as ``DistributedSampler``).
    Each window of ``world_size`` consecutive prompts gives one prompt to every rank; with
    ``prompt_lengths``, the longest prompt of the window goes to the rank with the fewest tokens so
    far (greedy longest-processing-time), which balances prompt tokens across ranks. Shards are
    disjoint and together cover the epoch; with ``drop_remainder`` every rank gets the same count and
    the last ``num_prompts % world_size`` prompts of the order are skipped.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be in [0, {world_size=})")
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_prompts, generator=g).tolist()
    else:
        order = list(range(num_prompts))
    if drop_remainder:
        order = order[: num_prompts - num_prompts % world_size]
    if prompt_lengths is None:
        return order[rank::world_size]
    if len(prompt_lengths) != num_prompts:
        raise ValueError(f"{len(prompt_lengths)=} must equal {num_prompts=}")
    loads = [0] * world_size
    mine: list[int] = []
    for start in range(0, len(order), world_size):
        window = sorted(order[start : start + world_size], key=lambda i: -prompt_lengths[i])
        ranks = sorted(range(world_size), key=lambda r: (loads[r], r))
        for idx, r in zip(window, ranks):
            loads[r] += prompt_lengths[idx]
            if r == rank:
                mine.append(idx)
    return mine


class PromptLedger:
    """Leases this rank's prompts to workers and records what happened to each.

    Args:
        num_prompts: size of the dataset.
        seed: seed of the per-epoch order.
        rank: this trainer rank; the ledger owns shard ``rank`` of ``world_size``.
        world_size: number of trainer ranks.
        lease_timeout_s: a lease not completed within this many seconds is re-issued.
        shuffle: shuffle the order per epoch.
        prompt_lengths: optional token counts used to balance shards across ranks.
        drop_remainder: give every rank the same number of prompts.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        num_prompts: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        lease_timeout_s: float = 300.0,
        shuffle: bool = True,
        prompt_lengths: Sequence[int] | None = None,
        drop_remainder: bool = False,
    ):
        if num_prompts <= 0:
            raise ValueError(f"{num_prompts=} must be > 0")
        if lease_timeout_s <= 0:
            raise ValueError(f"{lease_timeout_s=} must be > 0")
        self.num_prompts = num_prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.lease_timeout_s = lease_timeout_s
        self.shuffle = shuffle
        self.prompt_lengths = prompt_lengths
        self.drop_remainder = drop_remainder
        self._lease_ids = itertools.count(1)
        self.counters: collections.Counter[str] = collections.Counter()
        self.start_epoch(0)

    # -- epoch ---------------------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from scratch: every prompt of the shard PENDING, no leases."""
        self.epoch = epoch
        self.order = shard_indices(
            self.num_prompts,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            prompt_lengths=self.prompt_lengths,
            drop_remainder=self.drop_remainder,
        )
        self._position = {idx: pos for pos, idx in enumerate(self.order)}
        self._cursor = 0  # next position never issued in this epoch
        self._retry: collections.deque[int] = collections.deque()  # prompt indices to re-issue first
        self._attempts: dict[int, int] = {}
        self.leases: dict[int, Lease] = {}
        self._leases_of: dict[int, set[int]] = collections.defaultdict(set)
        self._held: collections.Counter[str] = collections.Counter()  # worker -> leases it holds (len(leases) split)
        self._leased_prompts = 0  # prompts with at least one live lease
        # workers that held a lease for the prompt in this epoch: the only ones whose group for it is accepted.
        # Not saved: a resumed run re-issues every outstanding lease, so only holders of the new timeline count.
        self._holders: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._buffered: set[int] = set()
        self._delivered: set[int] = set()  # yielded to the trainer, update not committed yet
        self._watermark = 0  # every position below it is consumed
        self._consumed_above: set[int] = set()
        self._failures: dict[int, tuple[int, str]] = {}  # prompt -> (failed attempts, last error)
        self._delayed: dict[int, float] = {}  # prompt -> when it may be re-issued (inf: parked as poisoned)
        self._skipped: set[int] = set()  # poisoned prompts skipped: done for the epoch, never consumed

    @property
    def shard_size(self) -> int:
        return len(self.order)

    @property
    def num_consumed(self) -> int:
        return self._watermark + len(self._consumed_above)

    @property
    def epoch_done(self) -> bool:
        return self.num_consumed + len(self._skipped) == len(self.order)

    @property
    def all_delivered(self) -> bool:
        """Every prompt of the epoch is delivered or consumed: nothing is left to yield."""
        return self.num_consumed + len(self._delivered) + len(self._skipped) == len(self.order)

    def next_in_order(self) -> int | None:
        """The first prompt of the shard's order not yet delivered or consumed (ordered delivery), or None."""
        pos = self._watermark
        while pos < len(self.order) and (pos in self._consumed_above or self.order[pos] in self._skipped
                                         or self.order[pos] in self._delivered):
            pos += 1
        return self.order[pos] if pos < len(self.order) else None

    def state_of(self, prompt_index: int) -> PromptState | None:
        """Where ``prompt_index`` is in this epoch, or None if it is not in this rank's shard."""
        pos = self._position.get(prompt_index)
        if pos is None:
            return None
        if prompt_index in self._skipped:
            return PromptState.SKIPPED
        if pos < self._watermark or pos in self._consumed_above:
            return PromptState.CONSUMED
        if prompt_index in self._buffered:
            return PromptState.BUFFERED
        if prompt_index in self._delivered:
            return PromptState.DELIVERED
        if self._leases_of.get(prompt_index):
            return PromptState.LEASED
        return PromptState.PENDING

    # -- leasing -------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self._retry) or bool(self._delayed) or self._cursor < len(self.order)

    def new_timeline(self) -> int:
        """Marks a reset: every lease issued from now on has an id >= the returned one (older results
        belong to the abandoned timeline)."""
        return next(self._lease_ids)

    def peek(self) -> int | None:
        """The prompt :meth:`lease` would issue next, or None if nothing is pending.

        Skips retry entries and cursor positions whose prompt is no longer PENDING: a group can
        arrive before its prompt's turn (a late group from a worker of a run that was resumed).
        """
        while self._retry:
            if self.state_of(self._retry[0]) is PromptState.PENDING:
                return self._retry[0]
            self._retry.popleft()
        while self._cursor < len(self.order):
            idx = self.order[self._cursor]
            if self.state_of(idx) is PromptState.PENDING:
                return idx
            self._cursor += 1
        return None

    def lease(self, worker_id: str, now: float) -> Lease | None:
        """Leases the next pending prompt to ``worker_id``, re-issues first; None if nothing is pending."""
        self.wake(now)
        idx = self.peek()
        if idx is None:
            return None
        if self._retry and self._retry[0] == idx:
            self._retry.popleft()
        else:
            self._cursor += 1
        return self._issue(idx, worker_id, now)

    def _issue(self, idx: int, worker_id: str, now: float) -> Lease:
        attempt = self._attempts.get(idx, -1) + 1
        self._attempts[idx] = attempt
        if attempt:
            self.counters["regenerated"] += 1
        lease = Lease(next(self._lease_ids), self.epoch, idx, worker_id, now + self.lease_timeout_s, attempt)
        self.leases[lease.lease_id] = lease
        self._leased_prompts += not self._leases_of[idx]
        self._leases_of[idx].add(lease.lease_id)
        self._held[worker_id] += 1
        self._holders[idx][worker_id] += 1  # leases delivered to it for this prompt
        self.counters["leased"] += 1
        return lease

    def _drop_lease(self, lease_id: int) -> Lease | None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            of = self._leases_of[lease.prompt_index]
            of.discard(lease_id)
            self._leased_prompts -= not of
            if (left := self._held[lease.worker_id] - 1) > 0:
                self._held[lease.worker_id] = left
            else:
                del self._held[lease.worker_id]
        return lease

    def held(self, worker_id: str) -> int:
        """Live leases ``worker_id`` holds (kept as leases come and go: no scan)."""
        return self._held[worker_id]

    def held_per_worker(self) -> collections.Counter[str]:
        """Live leases per worker (a copy)."""
        return self._held.copy()

    @property
    def num_leased_prompts(self) -> int:
        """Prompts with at least one live lease (kept as leases come and go: no scan)."""
        return self._leased_prompts

    def is_leased(self, prompt_index: int) -> bool:
        return bool(self._leases_of.get(prompt_index))

    def next_wake(self) -> float | None:
        """When the earliest failed prompt's re-issue backoff ends (:meth:`wake`), or None if none waits for one."""
        return min((t for t in self._delayed.values() if t != math.inf), default=None)

    def _requeue(self, idx: int, reason: str) -> None:
        self.counters[f"requeued_{reason}"] += 1
        self._retry.append(idx)

    def release(self, lease_id: int, reason: str) -> Lease | None:
        """Gives a lease back (worker failed it, left, or was cancelled); its prompt is re-issued."""
        lease = self._drop_lease(lease_id)
        if lease is not None and self.state_of(lease.prompt_index) is PromptState.PENDING:
            self._requeue(lease.prompt_index, reason)
        return lease

    def held_by(self, prompt_index: int, worker_id: str) -> bool:
        """True if ``worker_id`` holds, or held, a lease for ``prompt_index`` in this epoch (this timeline)."""
        holders = self._holders.get(prompt_index)
        return holders is not None and holders[worker_id] > 0

    def undeliver(self, lease_id: int) -> Lease | None:
        """Takes back a lease that never reached its worker (unroutable, queue full): as if it was never
        issued, so it counts neither as leased nor as a regeneration; its prompt goes first in the queue."""
        lease = self._drop_lease(lease_id)
        if lease is None:
            return None
        idx = lease.prompt_index
        if lease.attempt:
            self._attempts[idx] = lease.attempt - 1
            self.counters["regenerated"] -= 1
        else:
            self._attempts.pop(idx, None)
        self.counters["leased"] -= 1
        self.counters["undeliverable"] += 1
        self._holders[idx][lease.worker_id] -= 1  # it never had this one
        if self.state_of(idx) is PromptState.PENDING:
            self._retry.appendleft(idx)
        return lease

    def release_worker(self, worker_id: str, reason: str = "worker_lost") -> list[Lease]:
        """Releases every lease of a dead or departed worker."""
        gone = [lid for lid, lease in self.leases.items() if lease.worker_id == worker_id]
        return [lease for lid in gone if (lease := self.release(lid, reason)) is not None]

    def expire(self, now: float) -> list[Lease]:
        """Releases every lease past its deadline."""
        late = [lid for lid, lease in self.leases.items() if lease.deadline <= now]
        return [lease for lid in late if (lease := self.release(lid, "expired")) is not None]

    # -- results -------------------------------------------------------------------------------
    def complete(self, epoch: int, prompt_index: int, lease_id: int | None = None) -> tuple[bool, list[Lease]]:
        """Records that a whole group arrived for a prompt (through ``lease_id``, if known).

        Returns:
            ``(accepted, cancelled)``: accepted is False for a duplicate, another epoch or another
            rank's prompt; cancelled are the other leases of the prompt, now void.
        """
        if epoch != self.epoch or self.state_of(prompt_index) not in (PromptState.PENDING, PromptState.LEASED):
            return False, []
        dropped = [self._drop_lease(lid) for lid in list(self._leases_of.get(prompt_index, ()))]
        self._buffered.add(prompt_index)
        return True, [lease for lease in dropped if lease is not None and lease.lease_id != lease_id]

    def requeue_stale(self, prompt_index: int) -> None:
        """A buffered group was dropped for staleness: generate it again."""
        self._buffered.discard(prompt_index)
        self._requeue(prompt_index, "stale")

    def deliver(self, prompt_index: int) -> None:
        """Marks a buffered prompt as handed to the trainer (not yet trained on: see :meth:`consume`)."""
        if self.state_of(prompt_index) is not PromptState.BUFFERED:
            raise RuntimeError(f"prompt {prompt_index} of epoch {self.epoch} is {self.state_of(prompt_index)}, not buffered")
        self._buffered.discard(prompt_index)
        self._delivered.add(prompt_index)

    def consume(self, prompt_index: int) -> None:
        """Marks a delivered (or buffered) prompt as consumed: the trainer committed the update it fed."""
        if self.state_of(prompt_index) not in (PromptState.BUFFERED, PromptState.DELIVERED):
            raise RuntimeError(f"prompt {prompt_index} of epoch {self.epoch} is {self.state_of(prompt_index)}, "
                               "not buffered or delivered")
        self._buffered.discard(prompt_index)
        self._delivered.discard(prompt_index)
        self._consumed_above.add(self._position[prompt_index])
        while self._watermark in self._consumed_above:
            self._consumed_above.discard(self._watermark)
            self._watermark += 1
        self.counters["consumed"] += 1

    # -- failed attempts (poisoned prompts, asyncrl.pool.poison) -------------------------------------
    def record_failure(self, lease_id: int, error: str, now: float, backoff_s: float = 0.0) -> int | None:
        """A worker reported that it could not finish lease ``lease_id``: counts the failed attempt against
        its prompt and gives the lease back. The prompt is re-issued after
        :func:`~asyncrl.pool.poison.reissue_backoff_s` of its count (at once with ``backoff_s=0``).

        Returns:
            the prompt's failed attempts in this epoch, or None if the lease is not live (already
            released, expired, or its prompt completed): such a report counts for nothing.
        """
        lease = self._drop_lease(lease_id)
        if lease is None:
            return None
        idx = lease.prompt_index
        failures = self._failures.get(idx, (0, ""))[0] + 1
        self._failures[idx] = (failures, error)
        self.counters["lease_failures"] += 1
        if self.state_of(idx) is PromptState.PENDING:
            delay = reissue_backoff_s(failures, backoff_s)
            if delay > 0:
                self.counters["requeued_failed"] += 1
                self._delayed[idx] = min(self._delayed.get(idx, math.inf), now + delay)
            else:
                self._requeue(idx, "failed")
        return failures

    def failures_of(self, prompt_index: int) -> tuple[int, str]:
        """``(failed attempts, last error text)`` of a prompt in this epoch."""
        return self._failures.get(prompt_index, (0, ""))

    def failures(self) -> dict[int, tuple[int, str]]:
        """``prompt index -> (failed attempts, last error text)`` of this epoch's prompts that failed on workers."""
        return dict(self._failures)

    def wake(self, now: float) -> None:
        """Queues for re-issue every failed prompt whose backoff has passed."""
        for idx in [i for i, t in self._delayed.items() if t <= now]:
            del self._delayed[idx]
            self._retry.append(idx)

    def park(self, prompt_index: int) -> None:
        """Stops re-issuing a poisoned prompt (its live leases stay). It stays PENDING, so a checkpoint
        saves it as a prompt to generate, and a resume tries it again."""
        self._delayed[prompt_index] = math.inf
        self._retry = collections.deque(i for i in self._retry if i != prompt_index)

    @property
    def poisoned(self) -> int | None:
        """The first parked prompt still waiting for a group (the pool raises for it), or None."""
        for idx, t in self._delayed.items():
            if t == math.inf and self.state_of(idx) in (PromptState.PENDING, PromptState.LEASED):
                return idx
        return None

    def skip(self, prompt_index: int) -> list[Lease]:
        """Marks a poisoned prompt SKIPPED: done for the epoch, never consumed; its leases are void.

        Returns:
            the leases cancelled.
        """
        if self.state_of(prompt_index) not in (PromptState.PENDING, PromptState.LEASED):
            raise RuntimeError(f"prompt {prompt_index} of epoch {self.epoch} is {self.state_of(prompt_index)}; "
                               "only a pending or leased prompt can be skipped")
        dropped = [self._drop_lease(lid) for lid in list(self._leases_of.get(prompt_index, ()))]
        self._delayed.pop(prompt_index, None)
        self._skipped.add(prompt_index)
        return [lease for lease in dropped if lease is not None]

    @property
    def skipped(self) -> list[int]:
        """Prompts skipped as poisoned in this epoch, in the shard's order (never consumed)."""
        return sorted(self._skipped, key=self._position.__getitem__)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Cursor, consumed watermark, and every prompt that must be generated again on resume.

        Outstanding leases are saved as prompts to re-issue: their workers may not exist after a
        restart, and a late group from one that does is deduplicated by uid.
        """
        outstanding = sorted({lease.prompt_index for lease in self.leases.values()}, key=self._position.__getitem__)
        retry = list(dict.fromkeys([*outstanding, *self._retry, *self._delayed]))
        retry = [i for i in retry if self.state_of(i) not in (PromptState.BUFFERED, PromptState.DELIVERED, PromptState.CONSUMED)]
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "cursor": self._cursor,
            "retry": retry,
            "buffered": sorted(self._buffered | self._delivered, key=self._position.__getitem__),  # re-delivered
            "watermark": self._watermark,
            "consumed_above": sorted(self._consumed_above),
            "attempts": {str(k): v for k, v in self._attempts.items()},
            "failures": {str(k): list(v) for k, v in self._failures.items()},
            "skipped": sorted(self._skipped, key=self._position.__getitem__),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ledger saved by :meth:`state_dict` with the same dataset, seed and topology.

        Raises:
            ValueError: if the state was saved with another dataset size, seed or topology.
        """
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"ledger state version {state.get('version')!r} != {self.STATE_VERSION}")
        mine = (self.num_prompts, self.seed, self.rank, self.world_size)
        saved = (state["num_prompts"], state["seed"], state["rank"], state["world_size"])
        if saved != mine:
            raise ValueError(
                f"ledger state was saved for (num_prompts, seed, rank, world_size)={saved} but this run has {mine}; "
                "resume with the same dataset, seed and number of trainer ranks"
            )
        self.start_epoch(state["epoch"])
        self._cursor = state["cursor"]
        self._retry = collections.deque(state["retry"])
        self._buffered = set(state["buffered"])
        self._watermark = state["watermark"]
        self._consumed_above = set(state["consumed_above"])
        self._attempts = {int(k): v for k, v in state["attempts"].items()}
        self._failures = {int(k): (int(n), str(e)) for k, (n, e) in state.get("failures", {}).items()}
        self._skipped = set(state.get("skipped", ()))
        self.counters = collections.Counter(state["counters"])
