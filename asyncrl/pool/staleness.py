"""Policy versions and staleness: the one definition used by the pool, the loader and the metrics.

A policy version is an int, +1 per committed trainer update. The staleness of a rollout consumed at
trainer version ``v`` is ``v - rollout.policy_version``; with ``max_staleness = k`` no rollout older
than ``v - k`` is ever yielded (``k = 0`` is synchronous on-policy training, None is unbounded).
A consumer that fetches ``p`` batches ahead trains a group at ``v + p``, so the pool judges staleness there
(``LoaderConfig.prefetch``).

A version number alone does not name weights once a run is rolled back (a resume reuses 19, 20, ...):
staleness is measured only along one timeline, and rollouts newer than the trainer or from a rolled-back
incarnation are refused before staleness is ever asked (:mod:`asyncrl.pool.timeline`).
"""

from __future__ import annotations

__all__ = ["check_policy_version", "is_stale", "staleness"]


def staleness(trainer_version: int, rollout_version: int) -> int:
    """How many trainer updates a rollout is behind."""
    return trainer_version - rollout_version


def is_stale(rollout_version: int, trainer_version: int, max_staleness: int | None) -> bool:
    """True if a rollout of ``rollout_version`` must not be trained on at ``trainer_version``."""
    return max_staleness is not None and staleness(trainer_version, rollout_version) > max_staleness


def check_policy_version(new: int, current: int) -> None:
    """Raises if the trainer's policy version would go backwards (equal is a no-op update).

    Raises:
        ValueError: with both values in the message.
    """
    if not isinstance(new, int) or isinstance(new, bool):
        raise TypeError(f"policy_version must be an int, got {type(new).__name__}")
    if new < current:
        raise ValueError(f"policy_version={new} is lower than the current policy_version={current}; versions never decrease")
