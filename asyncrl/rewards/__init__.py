"""Reward functions: the weighted set a worker scores with, and the built-in functions ``reward.funcs`` names.

``reward_set.py``: :class:`RewardSet` (TRL's ``reward_funcs`` / ``reward_weights``, sync or async, batched);
``builtin.py``: ``math``, ``format``, ``reasoning_gym``, ``arithmetic``, ``visual``, ``fake``; ``legacy.py``: the
old two-argument form of the embedded rewards.
"""

from asyncrl.rewards.builtin import (
    arithmetic_reward,
    completion_text,
    fake_reward,
    format_reward,
    make_format_reward,
    math_reward,
    reasoning_gym_reward,
    visual_reward,
)
from asyncrl.rewards.reward_set import (
    BUILTIN,
    UNSCORED,
    RewardError,
    RewardSet,
    component_means,
    load_reward_func,
    reward_weights,
)

__all__ = [
    "BUILTIN",
    "UNSCORED",
    "RewardError",
    "RewardSet",
    "arithmetic_reward",
    "completion_text",
    "component_means",
    "fake_reward",
    "format_reward",
    "load_reward_func",
    "make_format_reward",
    "math_reward",
    "reasoning_gym_reward",
    "reward_weights",
    "visual_reward",
]
