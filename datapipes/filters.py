"""``GroupFilter``: drops groups by a predicate (e.g. GRPO groups whose rewards are all equal).

A dropped group counts as consumed by the pipeline (its prompt is not regenerated); the number
dropped is part of the state. Built-in predicate: :func:`has_reward_variance`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode

from asyncrl.rollout import Group

__all__ = ["GroupFilter", "has_reward_variance"]


def has_reward_variance(group: Group) -> bool:
    """False when every rollout of the group has the same reward (zero GRPO advantage)."""
    rewards = [r.reward for r in group.rollouts]
    return max(rewards) - min(rewards) > 1e-9


class GroupFilter(BaseNode[Group]):
    """Yields only the groups for which ``predicate(group)`` is True."""

    SOURCE_KEY = "source"
    NUM_FILTERED_KEY = "num_filtered"

    def __init__(self, source: BaseNode[Group], predicate: Callable[[Group], bool]):
        super().__init__()
        self.source = source
        self.predicate = predicate
        self.num_filtered = 0

    def reset(self, initial_state: dict[str, Any] | None = None):
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.num_filtered = initial_state[self.NUM_FILTERED_KEY]
        else:
            self.source.reset(None)
            self.num_filtered = 0

    def next(self) -> Group:
        while True:
            group = next(self.source)
            if self.predicate(group):
                return group
            self.num_filtered += 1

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.NUM_FILTERED_KEY: self.num_filtered}
