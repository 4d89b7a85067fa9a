"""Reward functions of the old form ``(prompt items, Completion objects) -> [float | dict]``, kept for code written
before :mod:`asyncrl.rewards.reward_set`.

``asyncrl.rewards.legacy:arithmetic_reward`` and ``asyncrl.rewards.legacy:fake_reward`` are the embedded task's and
the fake engine's rewards in that form (a :class:`~asyncrl.rewards.RewardSet` calls a two-argument function with the
worker's ``Completion`` objects); new code names the built-ins (``reward.funcs: [arithmetic]``), whose functions have
TRL's signature and come in weighted lists (:class:`asyncrl.rewards.RewardSet`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.rewards import builtin
from asyncrl.rewards.reward_set import load_reward_func

Completion = Any
"""A worker's ``workers.engines.base.Completion`` (``response_ids``, ``text``, ``finish_reason``; the core package never
imports the worker package, so it is not named here)."""

__all__ = ["RewardFn", "arithmetic_reward", "call_reward", "fake_reward", "load_reward", "split_reward"]

RewardFn = Callable[[Sequence[Any], Sequence[Completion]], Sequence[float | dict[str, float]]]


def fake_reward(prompts: Sequence[Any], completions: Sequence[Completion]) -> list[dict[str, float]]:
    """Deterministic reward for the fake engine: fraction of even token ids, plus a length component."""
    return builtin.fake_reward([c.response_ids.tolist() for c in completions])


def arithmetic_reward(prompts: Sequence[Any], completions: Sequence[Completion]) -> list[dict[str, float]]:
    """The embedded task's reward (:func:`asyncrl.rewards.arithmetic_reward`) on prompt items and Completions."""
    return builtin.arithmetic_reward([c.text or "" for c in completions], [p["answer"] for p in prompts],
                                     [c.finish_reason for c in completions])


def load_reward(spec: str) -> Callable[..., Any]:
    """Imports ``"module:function"`` (or a built-in name of :data:`asyncrl.rewards.BUILTIN`)."""
    return load_reward_func(spec)[1]


def call_reward(fn: Callable[..., Any], prompts: Sequence[Any], completions: Sequence[Completion]) -> list[Any]:
    """Calls one old-form reward function, sync or async, on one batch; checks it returned one value per completion.

    A one-off helper: the worker scores with :class:`asyncrl.rewards.RewardSet`, which keeps one event loop.
    """
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
