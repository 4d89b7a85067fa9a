"""Reward functions: batched callables ``(prompts, completions) -> rewards``.

A reward function receives parallel lists (one entry per completion, the prompt repeated for each
of its group's samples) and returns one value per completion: a float, or a dict with a ``"reward"``
key plus named components. It is named in configs as ``"module:function"``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from workers.engines.base import Completion

__all__ = ["RewardFn", "fake_reward", "load_reward", "split_reward"]

RewardFn = Callable[[Sequence[Any], Sequence[Completion]], Sequence[float | dict[str, float]]]


def fake_reward(prompts: Sequence[Any], completions: Sequence[Completion]) -> list[dict[str, float]]:
    """Deterministic reward for the fake engine: fraction of even token ids, plus a length component."""
    out = []
    for c in completions:
        n = max(int(c.response_ids.numel()), 1)
        even = float((c.response_ids % 2 == 0).sum()) / n
        out.append({"reward": even, "even_fraction": even, "length": float(c.response_ids.numel())})
    return out


def load_reward(spec: str) -> RewardFn:
    """Imports ``"module:function"``."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reward {spec!r} must be 'module:function'")
    return getattr(importlib.import_module(module), name)


def split_reward(value: float | dict[str, float]) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` from a reward function's value.

    Raises:
        ValueError: for a non-finite reward (the worker reports the lease as failed).
    """
    if isinstance(value, dict):
        reward = float(value["reward"])
        components = {k: float(v) for k, v in value.items() if k != "reward"}
    else:
        reward, components = float(value), {}
    if not math.isfinite(reward) or not all(math.isfinite(v) for v in components.values()):
        raise ValueError(f"reward function returned a non-finite value: {value!r}")
    return reward, components
