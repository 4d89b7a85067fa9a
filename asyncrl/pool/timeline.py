"""Timelines: which ``(incarnation, policy_version)`` pairs name weights the trainer's history really had.

A policy version alone does not name weights once a run is rolled back: a trainer that crashes at
version 20 and resumes from the checkpoint of version 18 reuses 19, 20, ... for *other* weights. A
worker still holding the dead run's version 20 would otherwise deliver rollouts the resumed policy
never produced (seen: whole batches consumed at staleness -2).

So every start or resume of a trainer is an **incarnation** (a random id, :func:`new_incarnation`),
and the run's history is a list of segments::

    [(inc_0, 0), (inc_1, 18), (inc_2, 31)]      inc_0 made versions 0..18, inc_1 18..31, inc_2 31..now

Segment ``k`` covers the versions from its start up to the start of segment ``k + 1`` (inclusive: the
resumed checkpoint *is* the older incarnation's weights of that version), the last one up to the
trainer's current version. A rollout stamped ``(inc, v)`` is on the timeline iff some segment of
``inc`` covers ``v``. The pool owns one :class:`Timeline`, saves it in its state and opens a new
segment when a saved state is loaded into a new incarnation.

Rollouts with incarnation ``""`` come from an engine that never received weights (no weight sync):
they are judged by version alone.
"""

from __future__ import annotations

import secrets
from typing import Any

__all__ = ["Timeline", "new_incarnation"]

MAX_SEGMENTS = 1024
"""Resumes remembered; older segments are forgotten (their versions are far beyond any staleness bound)."""


def new_incarnation() -> str:
    """A fresh incarnation id (16 hex chars): call once per trainer start or resume, share across ranks."""
    return secrets.token_hex(8)


class Timeline:
    """The segments of one run's history; the last one is the live incarnation.

    Args:
        incarnation: the live incarnation, starting at version 0.
    """

    def __init__(self, incarnation: str):
        if not incarnation:
            raise ValueError("incarnation must be a non-empty string (asyncrl.pool.timeline.new_incarnation())")
        self.segments: list[tuple[str, int]] = [(incarnation, 0)]

    @property
    def incarnation(self) -> str:
        """The live incarnation."""
        return self.segments[-1][0]

    def check(self, incarnation: str, version: int, trainer_version: int) -> str | None:
        """Why a rollout of ``(incarnation, version)`` must not be trained at ``trainer_version``, or None.

        Returns:
            ``"ahead_of_trainer"`` (a version the trainer has not reached), ``"dead_timeline"`` (weights of
            a rolled-back or unknown incarnation), or None.
        """
        if version > trainer_version:
            return "ahead_of_trainer"
        if not incarnation:
            return None
        for k, (inc, start) in enumerate(self.segments):
            if inc != incarnation:
                continue
            end = self.segments[k + 1][1] if k + 1 < len(self.segments) else trainer_version
            if start <= version <= end:
                return None
        return "dead_timeline"

    def continue_as(self, incarnation: str, version: int) -> None:
        """A new incarnation resumes the history at ``version`` (the checkpoint it loaded)."""
        if not incarnation:
            raise ValueError("incarnation must be a non-empty string")
        if incarnation == self.incarnation:
            return
        self.segments.append((incarnation, version))
        del self.segments[:-MAX_SEGMENTS]

    def state_dict(self) -> list[list[Any]]:
        return [[inc, start] for inc, start in self.segments]

    def load_state_dict(self, state: list[list[Any]], *, live: str, version: int) -> None:
        """Restores saved segments, then continues them as the live incarnation ``live`` at ``version``.

        Raises:
            ValueError: if ``state`` is not a list of ``[incarnation, start_version]`` pairs.
        """
        if not isinstance(state, list) or not state or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], int)
            for s in state
        ):
            raise ValueError(f"timeline state must be a non-empty list of [incarnation, start_version], got {state!r:.200}")
        self.segments = [(inc, start) for inc, start in state]
        self.continue_as(live, version)
