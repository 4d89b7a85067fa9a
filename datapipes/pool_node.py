"""``RolloutPoolNode``: the rollout pool as a ``torchdata.nodes.BaseNode`` yielding whole groups.

It is the source node of a trainer rank's loader graph. ``next()`` blocks on the pool's condition
(in slices of ``poll_timeout_s``, checking worker health in between) until a fresh group is ready;
it raises ``StopIteration`` once every prompt of this rank's shard of the epoch has been consumed.
``get_state()`` is the pool's state: ledger cursor, leases outstanding (saved as prompts to
re-issue), buffered and partial groups, groups delivered but not yet trained (re-delivered on
resume), consumed watermark, timeline and policy version. It owns every rollout not yet trained, so
nothing above it may prefetch with torchdata's Prefetcher (see the torchdata notes: it loses what it
buffered on restore); a consumer that prefetches says so with ``LoaderConfig.prefetch``.

``reset(None)`` starts the next epoch (the first call starts epoch 0), unless nothing was yielded
since the last reset: an ``iter()`` that yields nothing (Lightning calls ``iter()`` to check a loader)
does not advance or restart the epoch. ``reset(state)`` continues the saved run, in this process or a
new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode

from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.diagnosis import explain, snapshot
from asyncrl.rollout import Group
from asyncrl.transport import RolloutReceiver

__all__ = ["RolloutPoolNode"]


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
    ):
        super().__init__()
        self.pool = pool
        self.receiver = receiver
        self.poll_timeout_s = poll_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.health_check = health_check
        self.before_state = before_state
        self.on_epoch_end = on_epoch_end
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

    def next(self) -> Group:
        waited_since = time.monotonic()
        before = None  # the counters when the wait began (taken once the first poll came back empty)
        while True:
            if self._closed:
                raise RuntimeError("the RolloutLoader is closed (its receiver and workers are stopped); build a new "
                                   "one to continue")
            self._maybe_check_health(time.monotonic())
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

    def get_state(self) -> dict[str, Any]:
        if self.before_state is not None:
            self.before_state()
        else:
            self.pool.commit_delivered()
        return {self.VERSION_KEY: self.STATE_VERSION, self.POOL_KEY: self.pool.state_dict()}
