"""Reward functions: batched callables ``(prompts, completions) -> rewards``, sync or async.

A reward function receives parallel lists (one entry per completion; a group's prompt repeats for
each of its samples) and returns one value per completion: a float, or a dict with a ``"reward"``
key plus named components (logged, not trained on). ``async def`` reward functions (e.g. calling a
judge service) are awaited. Configs name them as ``"module:function"``.

Built in: :func:`arithmetic_reward` for the embedded task (``workers.tasks``) and
:func:`fake_reward` for the fake engine.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from workers.engines.base import Completion

__all__ = ["RewardFn", "arithmetic_reward", "call_reward", "fake_reward", "load_reward", "split_reward"]

RewardFn = Callable[[Sequence[Any], Sequence[Completion]], Sequence[float | dict[str, float]]]


def fake_reward(prompts: Sequence[Any], completions: Sequence[Completion]) -> list[dict[str, float]]:
    """Deterministic reward for the fake engine: fraction of even token ids, plus a length component."""
    out = []
    for c in completions:
        n = max(int(c.response_ids.numel()), 1)
        even = float((c.response_ids % 2 == 0).sum()) / n
        out.append({"reward": even, "even_fraction": even, "length": float(c.response_ids.numel())})
    return out


def arithmetic_reward(prompts: Sequence[Any], completions: Sequence[Completion]) -> list[dict[str, float]]:
    """The embedded task's reward: 1 for the exact answer, partial credit for a correct prefix.

    ``reward = exact + 0.5 * (1 - exact) * prefix``, where ``prefix`` is the fraction of the answer's
    characters the response starts with; ``stopped`` is 1 when the response ended by itself.
    """
    out = []
    for prompt, c in zip(prompts, completions):
        answer = str(prompt["answer"])
        text = (c.text or "").strip()
        exact = float(text == answer)
        prefix = 0
        while prefix < min(len(text), len(answer)) and text[prefix] == answer[prefix]:
            prefix += 1
        partial = prefix / len(answer)
        out.append(
            {
                "reward": exact + 0.5 * (1 - exact) * partial,
                "exact": exact,
                "prefix": partial,
                "stopped": float(c.finish_reason == "stop"),
            }
        )
    return out


def load_reward(spec: str) -> RewardFn:
    """Imports ``"module:function"``."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reward {spec!r} must be 'module:function'")
    return getattr(importlib.import_module(module), name)


def call_reward(fn: RewardFn, prompts: Sequence[Any], completions: Sequence[Completion]) -> list[Any]:
    """Calls a sync or async reward function; checks it returned one value per completion."""
    values = fn(prompts, completions)
    if inspect.isawaitable(values):
        values = asyncio.run(_await(values))
    values = list(values)
    if len(values) != len(completions):
        raise ValueError(f"reward function returned {len(values)} values for {len(completions)} completions")
    return values


async def _await(awaitable: Any) -> Any:
    return await awaitable


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
