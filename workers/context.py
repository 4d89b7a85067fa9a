"""``WorkerContext``: what a serving loop may use of the worker it serves for.

:class:`~workers.worker.RolloutWorker` owns the engine, the rollout sender, the weight receiver, the reward set, the
counters and the status; its static loop (``worker.py``) and the streaming loop (:mod:`workers.streaming`) both
serve through this interface, so the streaming loop needs nothing private of the worker and neither module imports
the other's loop. Nothing here blocks: the methods block where the worker's do (applying weights, scoring).
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncrl._logging import Throttle
from asyncrl.rewards.reward_set import RewardSet
from asyncrl.rollout import Group
from asyncrl.transport import ReceivedLease, RolloutSender
from workers.engines.base import Completion, Engine
from workers.environments import Environment

__all__ = ["WorkerContext"]


class WorkerContext(Protocol):
    """The worker as a serving loop sees it (implemented by :class:`~workers.worker.RolloutWorker`)."""

    worker_id: str
    engine: Engine
    sender: RolloutSender
    weights: Any | None
    """The weight receiver (:class:`~asyncrl.weights.WeightReceiver`); None without weight sync."""
    rewards: RewardSet
    environment: type[Environment] | None
    parent_pid: int | None
    """The loop ends when this process is gone (the local launcher)."""
    catch_up_s: float
    """How long a lease granted at weights the engine does not hold waits for them (``weights.catch_up_s``)."""
    throttle: Throttle
    """The worker's throttled logger: a failure that repeats logs a few lines."""
    busy_s: float
    """Seconds spent generating and rewarding (status ``busy_s``); loops add what they spend."""
    groups_resubmitted: int
    """Groups submitted again (aborted by an in-flight update, or finished under another incarnation)."""

    def apply_staged_weights(self, update: Any | None = None) -> bool:
        """Applies ``update`` (else the newest staged one) and commits its version; False if none was applied."""
        ...

    def make_group(self, lease: ReceivedLease, completions: list[Completion], scores: list[tuple[float, dict]],
                   generate_s: float, reward_s: float) -> Group:
        """The group of a lease's scored completions, every rollout stamped with its provenance."""
        ...

    def send_group(self, lease: ReceivedLease, group: Group) -> None:
        """Sends a lease's group back to the pool that granted it, and counts it."""
        ...

    def lease_failed(self, lease: ReceivedLease, error: Exception, culprit: str | None = None) -> None:
        """Reports one lease FAILED with the error's text and what failed (``culprit``; default: the error's own,
        else ``engine``); the pool counts it against the prompt."""
        ...

    def report(self) -> None:
        """Refreshes the status the pools see (sent with heartbeats)."""
        ...
