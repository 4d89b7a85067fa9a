"""torchdata nodes of the rollout pipeline and the loader built from them (trainer side)."""

from datapipes.collate import TrainBatch, collate_groups
from datapipes.filters import GroupFilter, has_reward_variance
from datapipes.loader import RolloutLoader
from datapipes.pool_node import RolloutPoolNode

__all__ = ["GroupFilter", "RolloutLoader", "RolloutPoolNode", "TrainBatch", "collate_groups", "has_reward_variance"]
