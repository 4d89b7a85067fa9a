"""Reward functions with weights (TRL's ``reward_funcs`` / ``reward_weights``): batched, sync or async.

::

    worker main thread ── RewardSet.score(groups) ──► each sync function: one call over the whole batch
                                                  └─► each async function: one call per group, all of them
                                                      gathered on the worker's one event loop

The worker's main thread blocks in :meth:`RewardSet.score` (between generation batches); async functions of
all groups and all functions run concurrently on one event loop the :class:`RewardSet` owns for its life (one
per worker), never one ``asyncio.run`` per group.

A reward function has TRL's signature, one entry per completion (a group's prompt repeats for each sample)::

    def f(prompts, completions, completion_ids, **columns) -> list[float | None]

- ``prompts``: the prompt as the dataset gives it: its ``messages`` (chat turns) if it has them, else its
  ``prompt``, else its ``text`` (None for a prompt given as token ids only);
- ``completions``: the completion's text; for a ``messages`` prompt TRL's conversational form,
  ``[{"role": "assistant", "content": text}]`` (:func:`completion_text` reads either);
- ``completion_ids``: the generated token ids (``list[int]``);
- ``columns``: every other column of the prompt item (``answer``, ``metadata``, ...), as lists, plus
  ``finish_reason`` (``"stop"``, ``"length"``, ...). Functions take ``**kwargs`` for the columns they ignore.

A value is a float, ``None`` (the function does not score this completion: TRL's NaN), or a dict with a
``"reward"`` key (a float or None) whose other keys are extra components. The rollout's reward is
``sum(w_i * r_i)`` over the functions that scored it (TRL's ``sum_then_normalize``: the trainer normalises the
sum); its ``reward_components`` hold each function's unweighted ``r_i`` under the function's name (and a dict
value's extra keys), which the recipe logs as means. A completion no function scores gets reward 0 and the
component ``unscored`` = 1; the trainer gives it advantage 0 and leaves it out of its group's mean, as TRL does.

Errors: a function that raises, returns the wrong number of values or a non-finite value fails the lease of
its group (so does a completion whose token ids do not decode into text, blamed on decoding): the worker reports it
FAILED with the error text and the culprit (``reward`` or ``decode``), and the pool counts it against the prompt
(:mod:`asyncrl.pool.poison`). A sync function that raises on a batch is called again group by group, so only the
guilty groups fail and nothing is generated twice.

Legacy functions ``f(prompts, completions)`` (exactly two parameters, no ``completion_ids``, no ``**kwargs``)
get the prompt items and :class:`~workers.engines.base.Completion` objects, as before.

Built in (``reward.funcs`` names, :mod:`asyncrl.rewards.builtin`, re-exported by :mod:`asyncrl.rewards`): ``math``
(:func:`math_reward`, ``math-verify``), ``format`` (:func:`format_reward`), ``reasoning_gym``
(:func:`reasoning_gym_reward`, the task's own ``score_answer``), ``arithmetic`` (:func:`arithmetic_reward`, the embedded
task), ``visual`` (:func:`visual_reward`, the visual tasks) and ``fake`` (:func:`fake_reward`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.rewards.builtin import (
    arithmetic_reward,
    fake_reward,
    format_reward,
    math_reward,
    reasoning_gym_reward,
    visual_reward,
)

__all__ = ["BUILTIN", "UNSCORED", "RewardError", "RewardSet", "component_means", "load_reward_func", "reward_weights"]

UNSCORED = "unscored"
"""Component set to 1 on a completion that no reward function scored (every one returned None)."""
PROMPT_KEYS = ("messages", "prompt", "text")
"""The first of these a prompt item has is what reward functions get as ``prompts``."""

Scored = tuple[float, dict[str, float]]
"""One completion's ``(reward, components)``."""


class RewardError(ValueError):
    """A reward function failed on a group; the message names the function (reported as the lease's error).

    Attributes:
        culprit: what failed, as the worker's FAILED report says (:data:`asyncrl.pool.poison.CULPRITS`):
            ``"reward"`` (the function raised or returned bad values) or ``"decode"`` (turning the completions' token
            ids into the text the function gets raised).
    """

    def __init__(self, message: str, culprit: str = "reward"):
        super().__init__(message)
        self.culprit = culprit


class _DecodeFailed(Exception):
    """The completion's token ids could not be decoded into text for the reward functions."""


BUILTIN: dict[str, Callable[..., Any]] = {
    "math": math_reward,
    "format": format_reward,
    "reasoning_gym": reasoning_gym_reward,
    "arithmetic": arithmetic_reward,
    "visual": visual_reward,
    "fake": fake_reward,
}
"""Short names ``reward.funcs`` accepts besides ``module:function``."""


def load_reward_func(spec: str) -> tuple[str, Callable[..., Any]]:
    """``(name, function)`` for a built-in name or ``"module:function"``; the name is the function's ``__name__``
    (the built-ins: their short name), under which its rewards are logged.

    Raises:
        ValueError: for an unknown name or a spec without ``:``.
        TypeError: for an attribute that is not callable.
    """
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"reward function {spec!r} must be one of {sorted(BUILTIN)} or 'module:function'")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise TypeError(f"reward function {spec!r}: {module} has no callable {attr!r}")
    return getattr(fn, "__name__", attr), fn


def reward_weights(config: Any) -> dict[str, float]:
    """``{name: weight}`` of a :class:`~asyncrl.config.RewardConfig`'s functions, under the names their rewards are
    logged with (the trainer's side of ``loss.multi_objective_aggregation: normalize_then_sum``)."""
    names = [load_reward_func(spec)[0] for spec in config.funcs]
    weights = config.weights if config.weights is not None else [1.0] * len(names)
    return {name: float(w) for name, w in zip(names, weights)}


# ---------------------------------------------------------------------------------------------------------------------
# the set of reward functions a worker scores with


def _is_legacy(fn: Callable[..., Any]) -> bool:
    """A function of ``(prompts, completions)`` only, written for Completion objects (before TRL's signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume TRL's
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params) or any(p.name == "completion_ids" for p in params):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) == 2


class RewardSet:
    """Reward functions with weights; scores a worker's batch of groups (see the module docstring).

    Args:
        funcs: the reward functions, sync or async.
        weights: one per function (None: all 1.0, as TRL).
        names: one per function, unique: its components' names (default: each function's ``__name__``).

    Raises:
        ValueError: on mismatched lengths, duplicate names or non-finite weights.
    """

    def __init__(self, funcs: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None,
                 names: Sequence[str] | None = None):
        if not funcs:
            raise ValueError("a RewardSet needs at least one reward function")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(funcs)] if names is None else list(names)
        if not len(weights) == len(names) == len(funcs):
            raise ValueError(f"{len(funcs)} reward functions need as many weights and names, got {weights=} {names=}")
        if len(set(names)) != len(names) or UNSCORED in names:
            raise ValueError(f"reward function names must be unique and not {UNSCORED!r}, got {names}")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite, got {weights}")
        self.funcs, self.weights, self.names = list(funcs), weights, names
        self._legacy = [_is_legacy(f) for f in funcs]
        self._async = [inspect.iscoroutinefunction(f) for f in funcs]
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, config: Any) -> RewardSet:
        """From a :class:`~asyncrl.config.RewardConfig` (``funcs``: names or ``module:function``; ``weights``)."""
        loaded = [load_reward_func(spec) for spec in config.funcs]
        return cls([fn for _, fn in loaded], config.weights, [name for name, _ in loaded])

    def score(self, groups: Sequence[tuple[Any, Sequence[Any]]],
              decode: Callable[[Any], str] | None = None) -> list[list[Scored] | RewardError]:
        """Scores a batch: ``groups`` of ``(prompt item, completions)``; per group its ``(reward, components)``
        per completion, or the :class:`RewardError` that fails its lease. ``decode`` turns response ids into
        text for completions without ``text`` (engines without a tokenizer leave text empty)."""
        values: list[list[list[Any] | RewardError]] = []  # [function][group]
        pending: list[tuple[int, int, Any]] = []
        for f, fn in enumerate(self.funcs):
            if self._async[f]:
                values.append([None] * len(groups))  # type: ignore[list-item]
                for g, (prompt, cs) in enumerate(groups):
                    try:  # the arguments are built (completions decoded) here, before the coroutine runs
                        pending.append((f, g, self._call(f, [prompt] * len(cs), cs, decode)))
                    except Exception as e:  # deliberate: this group's lease fails with the error, the others go on
                        values[f][g] = self._error(f, e)
            else:
                values.append(self._sync(f, groups, decode))
        if pending:
            results = self._gather([coro for _, _, coro in pending])
            for (f, g, _), result in zip(pending, results):
                values[f][g] = (self._check(f, result, len(groups[g][1])) if not isinstance(result, BaseException)
                                else self._error(f, result))
        out: list[list[Scored] | RewardError] = []
        for g in range(len(groups)):
            errors = [values[f][g] for f in range(len(self.funcs)) if isinstance(values[f][g], RewardError)]
            out.append(errors[0] if errors else self._combine([values[f][g] for f in range(len(self.funcs))]))
        return out

    def close(self) -> None:
        """Closes the event loop of the async functions."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -- internals ---------------------------------------------------------------------------------------------------
    def _sync(self, f: int, groups: Sequence[tuple[Any, Sequence[Any]]], decode) -> list[list[Any] | RewardError]:
        """One call over the whole batch; if it raises, one call per group so only the guilty groups fail."""
        prompts, completions = [], []
        for prompt, cs in groups:
            prompts += [prompt] * len(cs)
            completions += list(cs)
        try:
            batch = self._check(f, self._call(f, prompts, completions, decode), len(completions))
        except Exception as e:  # deliberate: a user's reward function; attribute the failure to groups below
            if len(groups) == 1:
                return [self._error(f, e)]
        else:
            out, start = [], 0
            for _, cs in groups:
                out.append(batch[start:start + len(cs)])
                start += len(cs)
            return out
        out = []
        for prompt, cs in groups:
            try:
                out.append(self._check(f, self._call(f, [prompt] * len(cs), list(cs), decode), len(cs)))
            except Exception as e:  # deliberate: this group's lease fails with the error, the others go on
                out.append(self._error(f, e))
        return out

    def _call(self, f: int, prompts: Sequence[Any], completions: Sequence[Any], decode) -> Any:
        fn = self.funcs[f]
        if self._legacy[f]:
            return fn(list(prompts), list(completions))
        return fn(**_trl_arguments(prompts, completions, decode))

    def _gather(self, coros: list[Any]) -> list[Any]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()

        async def gather() -> list[Any]:
            return await asyncio.gather(*coros, return_exceptions=True)

        return self._loop.run_until_complete(gather())

    def _check(self, f: int, values: Any, n: int) -> list[Any]:
        if inspect.isawaitable(values):
            raise RewardError(f"reward function {self.names[f]!r} returned an awaitable from a sync call; "
                              "declare it 'async def'")
        values = list(values)
        if len(values) != n:
            raise RewardError(f"reward function {self.names[f]!r} returned {len(values)} values for {n} completions")
        for v in values:
            reward = v.get("reward") if isinstance(v, dict) else v
            parts = [reward, *(x for k, x in v.items() if k != "reward")] if isinstance(v, dict) else [reward]
            for x in parts:
                if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)):
                    raise RewardError(f"reward function {self.names[f]!r} returned a non-finite or non-numeric "
                                      f"value: {v!r:.200}")
        return values

    def _error(self, f: int, e: BaseException) -> RewardError:
        if isinstance(e, RewardError):
            return e
        if isinstance(e, _DecodeFailed):  # not the function's fault: the tokenizer's
            cause = e.__cause__ or e
            error = RewardError(f"decoding a completion's token ids into text for reward function {self.names[f]!r} "
                                f"raised {type(cause).__name__}: {cause}", culprit="decode")
            error.__cause__ = cause
            return error
        error = RewardError(f"reward function {self.names[f]!r} raised {type(e).__name__}: {e}")
        error.__cause__ = e
        return error

    def _combine(self, per_func: list[list[Any]]) -> list[Scored]:
        """Weighted sum over the functions that scored each completion, with every function's value logged."""
        out = []
        for values in zip(*per_func):
            reward, scored, components = 0.0, False, {}
            for name, weight, v in zip(self.names, self.weights, values):
                r = v.get("reward") if isinstance(v, dict) else v
                if isinstance(v, dict):
                    components.update({k: float(x) for k, x in v.items() if k != "reward" and x is not None})
                if r is not None:
                    reward += weight * float(r)
                    components[name] = float(r)
                    scored = True
            if not scored:
                components[UNSCORED] = 1.0
            out.append((reward, components))
        return out


def _trl_arguments(prompts: Sequence[Any], completions: Sequence[Any], decode) -> dict[str, Any]:
    """TRL's keyword arguments for a batch of ``(prompt item, Completion)`` pairs."""
    items = [p if isinstance(p, dict) else {"text": p} for p in prompts]
    key = next((k for k in PROMPT_KEYS if items and k in items[0]), None)
    texts = []
    for c in completions:
        text = c.text
        if text is None:
            try:
                text = decode(c.response_ids) if decode is not None else ""
            except Exception as e:  # deliberate: reported as the decoding's failure, not the reward function's
                raise _DecodeFailed(str(e)) from e
        texts.append(text)
    conversational = key == "messages"
    columns: dict[str, list[Any]] = {}
    for item in items:
        for k in item:
            columns.setdefault(k, [])
    for k in list(columns):
        if k != key:
            columns[k] = [item.get(k) for item in items]
        else:
            del columns[k]
    columns.pop("prompt_ids", None)
    return {
        **columns,
        "prompts": [item.get(key) if key else None for item in items],
        "completions": [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts,
        "completion_ids": [[int(i) for i in c.response_ids.tolist()] for c in completions],
        "finish_reason": [c.finish_reason for c in completions],
    }


def component_means(components: dict[str, Any]) -> dict[str, float]:
    """Mean of each reward component over the rows that have it (a batch's ``reward_components``: name -> ``[B]``
    with NaN where missing), over all ranks of the default process group when there is one (every rank must call
    it: one small ``all_gather_object``, since ranks may have seen different components)."""
    import torch
    import torch.distributed as dist

    local = {}
    for name, values in components.items():
        seen = ~torch.isnan(values)
        local[name] = (float(values[seen].sum()), int(seen.sum()))
    parts = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, n) in part.items():
            acc = totals.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += n
    return {name: total / n for name, (total, n) in sorted(totals.items()) if n}
