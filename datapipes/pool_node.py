"""``RolloutPoolNode``: the rollout pool as a ``torchdata.nodes.BaseNode`` yielding whole groups.

It is the source node of a trainer rank's loader graph. ``next()`` blocks on the pool's condition
(in slices of ``poll_timeout_s``, checking worker health in between) until a fresh group is ready;
it raises ``StopIteration`` once every prompt of this rank's shard of the epoch has been consumed.
``get_state()`` is the pool's state: ledger cursor, leases outstanding (saved as prompts to
re-issue), buffered and partial groups, groups delivered but not yet trained (re-delivered on
resume), consumed watermark, timeline and policy version. It owns every rollout not yet trained, so
nothing above it may prefetch with torchdata's Prefetcher (see the torchdata notes: it loses what it
buffered on restore); a consumer that prefetches says so with ``LoaderConfig.prefetch``.

With a fleet floor (``min_workers``, ``rollout.min_workers``) ``next()`` pauses while fewer workers serve the pool
(:meth:`~asyncrl.transport.RolloutReceiver.ready_workers`): it takes nothing, the wait timeout does not run (a
fleet being restored is not a stalled one), and it resumes when enough serve again; the groups that arrive meanwhile
are buffered, judged for staleness when they are taken.

``reset(None)`` starts the next epoch (the first call starts epoch 0), unless nothing was yielded
since the last reset: an ``iter()`` that yields nothing (Lightning calls ``iter()`` to check a loader)
does not advance or restart the epoch. ``reset(state)`` continues the saved run, in this process or a
new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.diagnosis import explain, snapshot
from asyncrl.rollout import Group
from asyncrl.transport import RolloutReceiver

__all__ = ["RolloutPoolNode"]

logger = logging.getLogger(__name__)

PAUSE_SLICE_S = 0.25
"""How often a paused ``next()`` looks at the fleet again (a worker's HELLO does not wake it)."""
PAUSE_SAY_EVERY_S = 60.0
"""A pause still going on is said again this often."""


class RolloutPoolNode(BaseNode[Group]):
    """Yields fresh, whole groups from a :class:`~asyncrl.pool.buffer.RolloutPool`.

    Args:
        pool: the rank's pool.
        receiver: the transport feeding the pool (started on first reset).
        poll_timeout_s: wait slice between health checks.
        wait_timeout_s: raise ``TimeoutError`` if no group arrives for this long, saying why
            (:mod:`asyncrl.pool.diagnosis`); None: wait forever.
        health_check: called between waits (e.g. restart dead local workers); may raise.
        before_state: called first by ``get_state()`` (the loader commits what the consumer has trained:
            every delivered group but those of the batches it fetched ahead). None: every delivered group
            counts as consumed in the state, as a plain torchdata node's would.
        on_epoch_end: called when ``next()`` finds the epoch's end (before it raises ``StopIteration``).
        min_workers: the fleet's floor: ``next()`` pauses while fewer workers serve; 0: none.
    """

    STATE_VERSION = 1
    POOL_KEY = "pool"
    VERSION_KEY = "version"

    def __init__(
        self,
        pool: RolloutPool,
        receiver: RolloutReceiver,
        *,
        poll_timeout_s: float = 1.0,
        wait_timeout_s: float | None = None,
        health_check: Callable[[], None] | None = None,
        before_state: Callable[[], Any] | None = None,
        on_epoch_end: Callable[[], Any] | None = None,
        min_workers: int = 0,
    ):
        super().__init__()
        self.pool = pool
        self.receiver = receiver
        self.poll_timeout_s = poll_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.health_check = health_check
        self.before_state = before_state
        self.on_epoch_end = on_epoch_end
        self.min_workers = min_workers
        self.fleet = {"pauses": 0, "paused_s": 0.0, "ready_workers": None}
        """The floor's counters (:meth:`fleet_stats`): pauses begun, seconds of the pauses ended, the ready workers
        last seen."""
        self._paused_since: float | None = None
        """When the pause going on began (None: not paused)."""
        self._said_at = 0.0
        self._epochs_started = 0
        self._yielded_since_reset = 0
        self._next_check = 0.0
        self._closed = False

    def close(self) -> None:
        """From now on ``next()`` raises at once: the receiver and workers behind the pool are being stopped, and
        a group still buffered must stay in the saved state rather than be yielded to a loop that believes it
        closed the loader."""
        self._closed = True
        with self.pool.cond:
            self.pool.cond.notify_all()  # a next() blocked in take() wakes and sees it

    def reset(self, initial_state: dict[str, Any] | None = None):
        super().reset(initial_state)
        self.receiver.start()
        if initial_state is not None:
            if initial_state.get(self.VERSION_KEY) != self.STATE_VERSION:
                raise ValueError(
                    f"rollout pool node state version {initial_state.get(self.VERSION_KEY)!r} != {self.STATE_VERSION}"
                )
            self.pool.load_state_dict(initial_state[self.POOL_KEY])
        elif self._epochs_started and not self._yielded_since_reset and not self.pool.ledger.all_delivered:
            return  # an iter() that yielded nothing: carry on with the epoch (and leases) as they are
        elif self._epochs_started == 0:
            self.pool.start_epoch(self.pool.ledger.epoch)
        else:
            self.pool.start_epoch(self.pool.ledger.epoch + 1)
        self._epochs_started += 1
        self._yielded_since_reset = 0
        self.receiver.cancel_all()  # leases queued at workers belong to the abandoned timeline

    def _maybe_check_health(self, now: float) -> None:
        if self.health_check is not None and now >= self._next_check:
            self._next_check = now + self.poll_timeout_s
            self.health_check()

    def fleet_stats(self) -> dict[str, Any]:
        """The floor's counters with the pause going on counted up to now (``RolloutLoader.stats()["fleet"]``)."""
        since = self._paused_since
        out = {**self.fleet, "paused": since is not None, "min_workers": self.min_workers}
        if since is not None:
            out["paused_s"] += time.monotonic() - since
        return out

    def _below_floor(self, now: float) -> bool:
        """Whether fewer than ``min_workers`` serve the pool now; says when a pause begins, lasts, ends."""
        if not self.min_workers:
            return False
        ready = self.fleet["ready_workers"] = self.receiver.ready_workers()
        key = self.pool.config_key
        if ready >= self.min_workers:
            if self._paused_since is not None:
                paused = now - self._paused_since
                self.fleet["paused_s"] += paused
                self._paused_since = None
                logger.warning("%s: resumed after %.1f s paused: %d workers serve (%s.min_workers=%d)",
                               self.receiver.endpoint, paused, ready, key, self.min_workers)
            return False
        if self._paused_since is None:
            self._paused_since, self._said_at = now, now
            self.fleet["pauses"] += 1
            logger.warning("%s: paused: %d workers serve, fewer than %s.min_workers=%d; nothing is trained until "
                           "enough serve again (groups that arrive are kept)", self.receiver.endpoint, ready, key,
                           self.min_workers)
        elif now - self._said_at >= PAUSE_SAY_EVERY_S:
            self._said_at = now
            logger.warning("%s: still paused after %.0f s: %d workers serve, fewer than %s.min_workers=%d",
                           self.receiver.endpoint, now - self._paused_since, ready, key, self.min_workers)
        return True

    def next(self) -> Group:
        waited_since = time.monotonic()
        before = None  # the counters when the wait began (taken once the first poll came back empty)
        while True:
            if self._closed:
                raise RuntimeError("the RolloutLoader is closed (its receiver and workers are stopped); build a new "
                                   "one to continue")
            self._maybe_check_health(time.monotonic())
            if self._below_floor(time.monotonic()):
                time.sleep(min(PAUSE_SLICE_S, self.poll_timeout_s))
                waited_since, before = time.monotonic(), None  # the wait timeout counts from the resume
                continue
            try:
                group = self.pool.take(timeout=self.poll_timeout_s)
            except StopIteration:  # every prompt of the epoch delivered
                if self.on_epoch_end is not None:
                    self.on_epoch_end()
                raise
            if group is not None:
                self._yielded_since_reset += 1
                return group
            if self.wait_timeout_s is None:
                continue
            if before is None:
                before = snapshot(self.pool, self.receiver)
            now = time.monotonic()
            if now - waited_since > self.wait_timeout_s:
                raise TimeoutError(explain(before, snapshot(self.pool, self.receiver), waited_s=now - waited_since,
                                           max_staleness=self.pool.max_staleness, endpoint=self.receiver.endpoint,
                                           key=self.pool.config_key))

    @classmethod
    def pool_state_in(cls, state: Mapping[str, Any]) -> dict[str, Any]:
        """The pool's state inside the state of a loader graph over this node (``RolloutLoader.state_dict()``).

        Raises:
            ValueError: ``state`` holds no rollout pool node state.
        """
        node = state
        for key in cls._path_to_node(state):
            node = node[key]
        return node[cls.POOL_KEY]

    @classmethod
    def with_pool_state(cls, state: Mapping[str, Any], pool_state: dict[str, Any]) -> dict[str, Any]:
        """A copy of a loader graph's ``state`` whose pool state is ``pool_state`` (the dicts on the way are copied,
        everything else is shared)."""
        out = dict(state)
        node = out
        for key in cls._path_to_node(state):
            node[key] = dict(node[key])
            node = node[key]
        node[cls.POOL_KEY] = pool_state
        return out

    @classmethod
    def _path_to_node(cls, state: Mapping[str, Any]) -> list[str]:
        frontier: list[tuple[list[str], Mapping[str, Any]]] = [([], state)]
        while frontier:
            path, node = frontier.pop(0)
            if isinstance(node.get(cls.POOL_KEY), Mapping) and cls.VERSION_KEY in node:
                return path
            frontier += [([*path, k], v) for k, v in node.items() if isinstance(v, Mapping)]
        raise ValueError(f"no rollout pool node state in this state (keys {sorted(state)[:10]}): not a RolloutLoader's")

    def get_state(self) -> dict[str, Any]:
        if self.before_state is not None:
            self.before_state()
        else:
            self.pool.commit_delivered()
        return {self.VERSION_KEY: self.STATE_VERSION, self.POOL_KEY: self.pool.state_dict()}
