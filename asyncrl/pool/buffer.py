"""The rollout pool: the versioned, bounded, exactly-once buffer between workers and one trainer rank.

Who calls what (all under one lock; the condition wakes the trainer when a group is ready)::

    receiver I/O thread                       trainer thread (RolloutPoolNode.next)
    ───────────────────                       ─────────────────────────────────────
    add_rollouts(...)  ── complete group ──►  take(timeout) ── drops stale, delivers ──► Group
    grant(worker, n)   ◄── capacity freed ──  commit(epoch, prompts) ── the update they fed is committed
    expire(now) / release_worker(w)           set_policy_version(v) ── purges stale groups

A group is buffered whole, in arrival order. ``take`` drops groups older than
``policy_version - max_staleness`` and sends their prompts back to the ledger to be generated again
(counted, never silently lost). A yielded group is DELIVERED, not consumed: it is consumed when the
trainer commits the update it fed (:meth:`commit`), and until then :meth:`state_dict` saves it for
re-delivery, so a checkpoint taken while batches are prefetched loses none of them. With ``prefetch =
p`` (batches the consumer fetches ahead of the one it trains) a group is trained up to ``p`` versions
after it is taken, so ``take`` judges staleness at ``policy_version + p``.

One timeline: the pool rejects (and counts) rollouts newer than the trainer's policy version and
rollouts of a rolled-back incarnation (:mod:`asyncrl.pool.timeline`); its state carries the timeline, and
loading it into a new incarnation opens a new segment.

Capacity counts groups leased, partially received or buffered, so a stalled trainer stops lease grants
and with them generation (backpressure). Everything the trainer has not yet trained on lives here and
is part of :meth:`state_dict`.

With ``groups_per_step`` (the trainer's batch, in groups) the pool also leases only what can still be
trained fresh (AReaL's staleness control): at most ``(max_staleness + 1) * groups_per_step - taken``
groups in flight, ``taken`` being the groups yielded for the current step. A group leased at version
v is then consumed before the trainer passes v + max_staleness, so none is generated to be dropped;
with ``max_staleness = 0`` generation waits for each new version (synchronous RL). A step ends at
``set_policy_version(v' > v)``, or when the trainer asks for more than a step's groups without one
(a rejected update).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl._logging import Throttle
from asyncrl.pool.ledger import Lease, PromptLedger, PromptState
from asyncrl.pool.poison import PoisonedPromptError, PoisonPolicy
from asyncrl.pool.staleness import check_policy_version, is_stale
from asyncrl.pool.timeline import Timeline, new_incarnation
from asyncrl.rollout import Group, Rollout

__all__ = ["RolloutPool"]

logger = logging.getLogger(__name__)
_throttle = Throttle(logger)
_OFF_TIMELINE = {
    "ahead_of_trainer": "weights newer than the trainer (call set_policy_version(v) before publishing version v)",
    "ahead_of_resumed_trainer": "weights newer than this trainer, made before it resumed from an older checkpoint "
    "(the workers still hold the previous run's weights): publish the resumed weights with "
    "incarnation=loader.incarnation, which receivers take whatever their version; until then they are refused",
    "dead_timeline": "weights of a rolled-back trainer incarnation (regenerated with the live weights)",
}


class RolloutPool:
    """Buffer of complete groups for one trainer rank, with its :class:`PromptLedger`.

    Args:
        ledger: the rank's prompt ledger (owned by the pool from now on).
        group_size: rollouts per prompt (GRPO ``n``).
        capacity: most groups leased, partially received and buffered at once.
        max_staleness: largest ``trainer_version - rollout.policy_version`` yielded; None = unbounded.
        max_buffer_bytes: optional bound on the bytes of buffered rollouts; grants stop above it.
        ordered: yield groups in the ledger's order instead of arrival order (reproducible batches at the
            cost of head-of-line blocking; with ``max_staleness=0`` and per-request seeding a run is
            deterministic whatever the workers' timing).
        groups_per_step: groups the trainer consumes per optimizer step; with ``max_staleness`` set, leases
            are granted only for groups that can still be trained within it. None = capacity only.
        prefetch: batches the consumer fetches ahead of the one it trains (0: a plain loop; 1: Lightning);
            staleness is judged at the version the group will be trained at. Must be <= ``max_staleness``.
        incarnation: this trainer incarnation (:func:`asyncrl.pool.timeline.new_incarnation`); default a new one.
        max_prompt_failures: failed attempts (leases reported FAILED) after which a prompt is poisoned
            (:mod:`asyncrl.pool.poison`); None = never.
        on_poisoned_prompt: ``"raise"``: :meth:`take` raises :class:`~asyncrl.pool.poison.PoisonedPromptError`;
            ``"skip"``: the prompt is skipped for the epoch (counted in ``stats["skipped_poisoned"]``).
        failure_backoff_s: a failed prompt is re-issued after this many seconds, doubled per failed attempt.
        config_key: how errors name the loader's settings: ``LoaderConfig`` or a run file's section (``rollout``).
    """

    STATE_VERSION = 2

    def __init__(
        self,
        ledger: PromptLedger,
        *,
        group_size: int,
        capacity: int,
        max_staleness: int | None = None,
        max_buffer_bytes: int | None = None,
        ordered: bool = False,
        groups_per_step: int | None = None,
        prefetch: int = 0,
        incarnation: str | None = None,
        max_prompt_failures: int | None = 3,
        on_poisoned_prompt: PoisonPolicy = "raise",
        failure_backoff_s: float = 0.5,
        config_key: str = "LoaderConfig",
    ):
        if max_prompt_failures is not None and max_prompt_failures < 1:
            raise ValueError(f"{max_prompt_failures=} must be >= 1 (or None: never poisoned)")
        if on_poisoned_prompt not in ("raise", "skip") or failure_backoff_s < 0:
            raise ValueError(f"need {on_poisoned_prompt=} in ('raise', 'skip') and {failure_backoff_s=} >= 0")
        self.max_prompt_failures = max_prompt_failures
        self.on_poisoned_prompt = on_poisoned_prompt
        self.failure_backoff_s = failure_backoff_s
        self.config_key = config_key
        self._culprits: dict[int, str] = {}  # prompt -> what failed in its last failed attempt (this epoch)
        if prefetch < 0 or (max_staleness is not None and prefetch > max_staleness):
            raise ValueError(
                f"{prefetch=} must be in [0, {max_staleness=}]: a consumer that fetches p batches ahead trains each "
                "group up to p versions after it is taken; raise max_staleness or fetch less ahead"
            )
        if group_size < 1:
            raise ValueError(f"{group_size=} must be >= 1")
        if capacity < 1:
            raise ValueError(f"{capacity=} must be >= 1")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"{max_staleness=} must be >= 0 (or None for unbounded)")
        self.ledger = ledger
        self.group_size = group_size
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_buffer_bytes = max_buffer_bytes
        self.ordered = ordered
        if groups_per_step is not None and groups_per_step < 1:
            raise ValueError(f"{groups_per_step=} must be >= 1 (or None)")
        self.groups_per_step = groups_per_step if max_staleness is not None else None
        self.prefetch = prefetch
        self.timeline = Timeline(incarnation or new_incarnation())
        self.step_taken = 0  # groups yielded for the trainer's current step
        self.cond = threading.Condition()
        self.policy_version = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.peak = collections.Counter()  # high-water marks: groups_in_flight, buffered_bytes
        self._ready: collections.OrderedDict[int, Group] = collections.OrderedDict()
        self._delivered: collections.OrderedDict[int, Group] = collections.OrderedDict()  # yielded, not committed
        self._partial: dict[int, dict[int, Rollout]] = {}
        self.buffered_bytes = 0
        self.min_lease_id = 0  # results of older leases belong to a timeline abandoned by a reset
        # lease id -> worker of the leases a reset cancelled (bounded): their late answers are not forgeries
        self._cancelled: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._error: BaseException | None = None
        self.active = False  # no leases before the loader's first iter(): it may still load a state dict
        self.withheld: str | None = None
        """Why the last :meth:`grant` leased fewer than asked (None: all of them): ``"window"`` (the staleness window,
        :attr:`fresh_budget`, i.e. groups leased and buffered that the trainer has not taken yet), ``"capacity"``,
        ``"bytes"`` (``max_buffer_bytes``) or ``"no_prompt"`` (nothing left to lease, or the loader not started)."""
        self.on_change: Callable[[], None] | None = None
        """Called (under the pool's lock; it must not block or take it) when the trainer's side may have let the pool
        grant more: a group taken, a version set, a commit, a new epoch, a loaded state. The receiver wakes its I/O
        thread with it, so that grants follow the trainer at once instead of a tick."""

    # -- receiver side -------------------------------------------------------------------------
    @property
    def groups_in_flight(self) -> int:
        """Prompts leased or partially received (each once), plus buffered groups."""
        # counted as leases come and go: a grant pass asks once per lease, and leases grow with workers
        partial_only = sum(1 for index in self._partial if not self.ledger.is_leased(index))
        return len(self._ready) + self.ledger.num_leased_prompts + partial_only

    def add_rollouts(self, rollouts: list[Rollout], *, lease_id: int | None = None) -> int:
        """Adds received rollouts; completes groups; deduplicates by uid.

        Returns:
            the number of rollouts accepted (the rest are counted in ``stats`` by reason).
        """
        accepted = 0
        with self.cond:
            if lease_id is not None and lease_id < self.min_lease_id:
                self.stats["superseded"] += len(rollouts)
                return 0
            off_timeline = next((why for r in rollouts if (why := self._timeline_reason(r))), None)
            if off_timeline:  # the whole group: its rollouts share weights that the trainer never had
                self.stats[off_timeline] += len(rollouts)
                r = rollouts[0]
                why = off_timeline
                if why == "ahead_of_trainer" and r.incarnation != self.incarnation and len(self.timeline.segments) > 1:
                    why = "ahead_of_resumed_trainer"  # not a call-order slip: the workers outlived the previous run
                _throttle.warning(
                    why, "pool refused rollouts of %s (policy_version %d, incarnation %r) at trainer version "
                    "%d, incarnation %r: %s", r.group_id, r.policy_version, r.incarnation, self.policy_version,
                    self.incarnation, _OFF_TIMELINE[why])
                return 0
            for r in rollouts:
                reason = self._reject_reason(r)
                if reason:
                    self.stats[reason] += 1
                    continue
                part = self._partial.setdefault(r.prompt_index, {})
                part[r.sample_index] = r
                self.buffered_bytes += r.nbytes
                accepted += 1
                if len(part) == self.group_size:
                    self._complete(r.epoch, r.prompt_index, lease_id)
            self.stats["rollouts_received"] += accepted
            self._update_peaks()
        return accepted

    @property
    def incarnation(self) -> str:
        """The live trainer incarnation (workers are told it with every lease and heartbeat)."""
        return self.timeline.incarnation

    def _timeline_reason(self, r: Rollout) -> str | None:
        newest = max(v for v, _, _ in r.spans())
        return self.timeline.check(r.incarnation, max(newest, r.policy_version), self.policy_version)

    def _reject_reason(self, r: Rollout) -> str | None:
        if r.epoch != self.ledger.epoch:
            return "wrong_epoch"
        state = self.ledger.state_of(r.prompt_index)
        if state is None:
            return "not_in_shard"
        if state is PromptState.SKIPPED:
            return "skipped_prompt"
        if state in (PromptState.BUFFERED, PromptState.DELIVERED, PromptState.CONSUMED):
            return "duplicate"
        if not 0 <= r.sample_index < self.group_size:
            return "bad_sample_index"
        if r.sample_index in self._partial.get(r.prompt_index, ()):
            return "duplicate"
        return None

    def _complete(self, epoch: int, prompt_index: int, lease_id: int | None) -> None:
        part = self._partial.pop(prompt_index)
        ok, cancelled = self.ledger.complete(epoch, prompt_index, lease_id)
        assert ok, f"prompt {prompt_index} completed twice"  # _reject_reason admits only pending/leased prompts
        self.stats["cancelled_leases"] += len(cancelled)
        group = Group(epoch=epoch, prompt_index=prompt_index, rollouts=[part[i] for i in range(self.group_size)])
        self._ready[prompt_index] = group
        self.stats["groups_received"] += 1
        self.cond.notify_all()

    def grant(self, worker_id: str, want: int, now: float | None = None) -> list[Lease]:
        """Leases up to ``want`` prompts to a worker, within the pool's capacity (the worker's credits)."""
        now = time.monotonic() if now is None else now
        out: list[Lease] = []
        with self.cond:
            self.ledger.wake(now)  # failed prompts whose re-issue backoff has passed
            withheld = None if self.active else "no_prompt"
            while self.active and len(out) < want:
                index = self.ledger.peek()
                if index is None:
                    withheld = "no_prompt"
                    break
                # a prompt with part of its group here already counts as in flight: finishing it is
                # always allowed, or orphaned partial groups could fill the capacity for good
                if index not in self._partial and (in_flight := self.groups_in_flight) >= min(self.capacity,
                                                                                              self.fresh_budget):
                    withheld = "capacity" if in_flight >= self.capacity else "window"
                    break
                if self.max_buffer_bytes is not None and self.buffered_bytes >= self.max_buffer_bytes:
                    withheld = "bytes"
                    break
                lease = self.ledger.lease(worker_id, now)
                assert lease is not None and lease.prompt_index == index
                out.append(lease)
            self.withheld = withheld if want > 0 else None
            self._update_peaks()
        return out

    @property
    def fresh_budget(self) -> float:
        """Most groups in flight that can still be trained within ``max_staleness`` (inf: unbounded)."""
        if self.groups_per_step is None:
            return float("inf")
        return (self.max_staleness - self.prefetch + 1) * self.groups_per_step - self.step_taken

    def release(self, lease_id: int, reason: str) -> None:
        with self.cond:
            self.ledger.release(lease_id, reason)

    def release_held(self, lease_id: int, worker_id: str, reason: str) -> None:
        """Releases a lease if ``worker_id`` still holds it (a result for it was rejected, or it failed)."""
        with self.cond:
            lease = self.ledger.leases.get(lease_id)
            if lease is not None and lease.worker_id == worker_id:
                self.ledger.release(lease_id, reason)

    def lease_failed(self, lease_id: int, worker_id: str, error: str, now: float | None = None,
                     culprit: str = "unknown") -> int | None:
        """A worker reports that it could not finish a lease it holds (engine or reward error; ``culprit`` says
        which: :data:`asyncrl.pool.poison.CULPRITS`).

        The failed attempt is counted against the prompt and the prompt is re-issued after a backoff;
        at ``max_prompt_failures`` it is poisoned: parked, and :meth:`take` raises (``"raise"``), or
        skipped for the epoch (``"skip"``). A report for a lease the worker does not hold counts for nothing.

        Returns:
            the prompt's failed attempts in this epoch, or None if the report was ignored.
        """
        now = time.monotonic() if now is None else now
        with self.cond:
            lease = self.ledger.leases.get(lease_id)
            if lease is None or lease.worker_id != worker_id:
                return None
            failures = self.ledger.record_failure(lease_id, error, now, self.failure_backoff_s)
            if failures is not None:
                self._culprits[lease.prompt_index] = culprit
            if failures is None or self.max_prompt_failures is None or failures < self.max_prompt_failures:
                return failures
            if self.ledger.state_of(lease.prompt_index) not in (PromptState.PENDING, PromptState.LEASED):
                return failures  # its group arrived meanwhile through another lease
            if self.on_poisoned_prompt == "skip":
                self.stats["cancelled_leases"] += len(self.ledger.skip(lease.prompt_index))
                self.stats["skipped_poisoned"] += 1
            else:
                self.ledger.park(lease.prompt_index)
            self.cond.notify_all()  # take() raises, or sees the epoch end
            return failures

    def held_by(self, epoch: int, prompt_index: int, worker_id: str) -> bool:
        """The gate's ownership check: True if ``worker_id`` holds or held a lease for ``prompt_index`` in
        ``epoch`` (the current epoch and timeline). The receiver refuses other groups (``not_leased_to_peer``)."""
        with self.cond:
            return epoch == self.ledger.epoch and self.ledger.held_by(prompt_index, worker_id)

    def cancelled_lease_of(self, lease_id: int, worker_id: str) -> bool:
        """True if ``lease_id`` was leased to ``worker_id`` and then cancelled by a reset (a loaded state, a new epoch):
        a group answering it is late, not forged (the receiver counts it as ``cancelled_lease_answers``)."""
        with self.cond:
            return self._cancelled.get(lease_id) == worker_id

    def _new_timeline(self) -> None:
        """Cancels every outstanding lease (remembering whose it was) and opens a new lease timeline."""
        for lease_id, lease in self.ledger.leases.items():
            self._cancelled[lease_id] = lease.worker_id
        while len(self._cancelled) > 4 * self.capacity:  # at most capacity leases are outstanding per reset
            self._cancelled.popitem(last=False)
        self.min_lease_id = self.ledger.new_timeline()

    def undeliver(self, leases: list[Lease]) -> None:
        """Takes back leases that never reached their worker; they count neither as leased nor regenerated."""
        with self.cond:
            for lease in leases:
                self.ledger.undeliver(lease.lease_id)

    def release_worker(self, worker_id: str, reason: str = "worker_lost") -> list[Lease]:
        with self.cond:
            return self.ledger.release_worker(worker_id, reason)

    def expire(self, now: float | None = None) -> list[Lease]:
        with self.cond:
            return self.ledger.expire(time.monotonic() if now is None else now)

    def outstanding(self) -> collections.Counter[str]:
        """Leases held per worker."""
        with self.cond:
            return self.ledger.held_per_worker()

    def held(self, worker_id: str) -> int:
        """Leases ``worker_id`` holds."""
        with self.cond:
            return self.ledger.held(worker_id)

    def next_wake(self) -> float | None:
        """When a failed prompt's re-issue backoff ends next (a grant may then succeed), or None."""
        with self.cond:
            return self.ledger.next_wake()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def fail(self, error: BaseException) -> None:
        """Called by the receiver thread when it dies: the trainer's next ``take`` re-raises it."""
        with self.cond:
            self._error = error
            self.cond.notify_all()

    def _update_peaks(self) -> None:
        self.peak["groups_in_flight"] = max(self.peak["groups_in_flight"], self.groups_in_flight)
        self.peak["buffered_bytes"] = max(self.peak["buffered_bytes"], self.buffered_bytes)

    # -- trainer side --------------------------------------------------------------------------
    def take(self, timeout: float) -> Group | None:
        """The next fresh group, or None after ``timeout`` seconds.

        Raises:
            StopIteration: when every prompt of this rank's shard of the epoch has been consumed.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            if self.groups_per_step is not None and self.step_taken >= self.groups_per_step:
                self.step_taken = 0  # a new step at the same version (the last update was rejected)
                self._changed()
            while True:
                if self._error is not None:
                    raise RuntimeError("rollout receiver failed") from self._error
                if (poisoned := self.ledger.poisoned) is not None:  # on_poisoned_prompt="raise"
                    raise PoisonedPromptError(self.ledger.epoch, poisoned, *self.ledger.failures_of(poisoned),
                                              culprit=self._culprits.get(poisoned, "unknown"),
                                              config_key=self.config_key)
                while self._ready:
                    if self.ordered:
                        index = self.ledger.next_in_order()
                        if index not in self._ready:
                            break
                        group = self._ready.pop(index)
                    else:
                        index, group = self._ready.popitem(last=False)
                    self.buffered_bytes -= group.nbytes
                    if is_stale(group.policy_version, self.policy_version + self.prefetch, self.max_staleness):
                        self._drop_stale(index)
                        continue
                    self.ledger.deliver(index)
                    self._delivered[index] = group
                    self.stats["groups_yielded"] += 1
                    self.step_taken += 1
                    self._changed()
                    return group
                if self.ledger.all_delivered:
                    raise StopIteration
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.cond.wait(remaining)

    def _drop_stale(self, index: int) -> None:
        self.ledger.requeue_stale(index)
        self.stats["stale_dropped"] += 1
        self._changed()

    def set_policy_version(self, version: int) -> None:
        """Tells the pool the trainer's current policy version; buffered groups now stale are dropped.

        Raises:
            ValueError: if ``version`` is lower than the current one.
        """
        with self.cond:
            check_policy_version(version, self.policy_version)
            if version > self.policy_version:
                self.step_taken = 0
                self._changed()
            self.policy_version = version
            trained_at = version + self.prefetch
            for index in [i for i, g in self._ready.items() if is_stale(g.policy_version, trained_at, self.max_staleness)]:
                self.buffered_bytes -= self._ready.pop(index).nbytes
                self._drop_stale(index)

    def commit(self, epoch: int, prompt_indices: list[int], *, generation: int | None = None) -> int:
        """Records that the trainer committed the update fed by these delivered groups: they are consumed.

        Args:
            epoch: the epoch the groups were delivered in.
            prompt_indices: their prompts.
            generation: ``min_lease_id`` when they were delivered; a reset since (a loaded state, a new
                epoch) voids the commit, as the groups were put back to be delivered again.

        Groups of another epoch or generation, or not delivered, are ignored and counted as
        ``commit_ignored``. Returns the number consumed.
        """
        n = 0
        with self.cond:
            for index in prompt_indices:
                if (epoch != self.ledger.epoch or index not in self._delivered
                        or (generation is not None and generation != self.min_lease_id)):
                    self.stats["commit_ignored"] += 1
                    continue
                del self._delivered[index]
                self.ledger.consume(index)
                n += 1
            self.stats["groups_committed"] += n
            self.cond.notify_all()
            self._changed()
        return n

    def commit_delivered(self, *, except_prompts: set[int] | frozenset[int] = frozenset()) -> int:
        """Consumes every delivered group of this epoch except ``except_prompts`` (those the consumer has
        fetched but not trained yet). Returns the number consumed."""
        with self.cond:
            done = [i for i in self._delivered if i not in except_prompts]
            return self.commit(self.ledger.epoch, done) if done else 0

    @property
    def num_delivered(self) -> int:
        """Groups yielded whose update is not committed yet."""
        with self.cond:
            return len(self._delivered)

    def start_epoch(self, epoch: int) -> None:
        """Abandons whatever is left of the current epoch and starts ``epoch``."""
        with self.cond:
            self._new_timeline()
            self.stats["abandoned_uncommitted"] += len(self._delivered)
            self._delivered.clear()
            self._ready.clear()
            self._partial.clear()
            self.buffered_bytes = 0
            self._culprits.clear()
            self.ledger.start_epoch(epoch)
            self.active = True
            self._changed()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything not yet given to the trainer: ledger, buffered and partial groups, version."""
        with self.cond:
            return {
                "version": self.STATE_VERSION,
                "group_size": self.group_size,
                "policy_version": self.policy_version,
                "timeline": self.timeline.state_dict(),
                "ledger": self.ledger.state_dict(),
                # delivered but not committed first: they are delivered again, in the same order, on resume
                "ready": [g.to_wire() for g in (*self._delivered.values(), *self._ready.values())],
                "partial": [r.to_wire() for part in self._partial.values() for r in part.values()],
                "stats": dict(self.stats),
                "step_taken": self.step_taken,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a saved pool; leases outstanding at save time will be issued again.

        Raises:
            ValueError: if the state comes from another schema version or group size.
        """
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"pool state version {state.get('version')!r} != {self.STATE_VERSION}")
        if state["group_size"] != self.group_size:
            raise ValueError(f"pool state has group_size={state['group_size']} but this run has {self.group_size}")
        with self.cond:
            self._new_timeline()
            self.ledger.load_state_dict(state["ledger"])
            self.policy_version = state["policy_version"]
            self.timeline.load_state_dict(state["timeline"], live=self.incarnation, version=self.policy_version)
            self._ready.clear()
            self._delivered.clear()
            self._partial.clear()
            for g in state["ready"]:
                group = Group.from_wire(g, group_size=self.group_size)
                self._ready[group.prompt_index] = group
            for r in state["partial"]:
                rollout = Rollout.from_wire(r)
                self._partial.setdefault(rollout.prompt_index, {})[rollout.sample_index] = rollout
            self.buffered_bytes = sum(g.nbytes for g in self._ready.values()) + sum(
                r.nbytes for part in self._partial.values() for r in part.values()
            )
            self.stats = collections.Counter(state["stats"])
            self.step_taken = state.get("step_taken", 0)
            self.active = True
            self.cond.notify_all()
            self._changed()
