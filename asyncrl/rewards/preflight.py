"""Reward functions tried in the trainer before any worker starts: imported as the workers will import them, and
called once on a sample, so a reward that cannot work fails in seconds, naming itself, instead of in every worker.

::

    trainer, before the loader starts its workers
        try_rewards(config, sample)    import each function; call the set once on (sample prompt, its answer as the
                                       completion); a function that raises, or returns the wrong number or kind of
                                       values, is named with the fix
        import_dirs(config)            the directories those modules came from that a worker (a fresh
                                       ``python -m workers`` in the trainer's working directory) would not search
        worker_env(config)             ``{"PYTHONPATH": ...}`` for the workers: they import from the same places

Where ``module:function`` is found: Python's import path of the process that imports it. A worker searches its
working directory (the trainer's) and ``PYTHONPATH``; the trainer its script's directory too, and the recipe adds
the working directory and the run file's directory. Whatever directory the trainer imported a reward module from
is added to its workers' ``PYTHONPATH`` (:func:`worker_env`), so trainer and workers always import the same module.

Nothing here blocks but the reward functions themselves (one call, on the trainer's thread).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.rewards.reward_set import BUILTIN, RewardError, RewardSet, load_reward_func

__all__ = ["RewardCheckError", "import_dirs", "reward_columns", "try_rewards", "worker_env"]

TRL_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "finish_reason"})
"""Keyword arguments every TRL-style reward function gets that are not dataset columns."""


class RewardCheckError(ValueError):
    """A reward function that cannot work: not importable, not callable, or failing on a sample (the message says
    which, with the fix)."""


@dataclass(slots=True)
class SampleCompletion:
    """What a worker's completion looks like to a reward function (``workers.engines.base.Completion``'s fields),
    for the one call on a sample."""

    text: str
    prompt_ids: Any = None
    response_ids: Any = None
    logprobs: Any = None
    finish_reason: str = "stop"
    policy_version: int = 0
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    loss_mask: Any = None
    env_reward: float | None = None
    env_info: dict[str, float] = field(default_factory=dict)


def _load(spec: str, key: str) -> tuple[str, Any]:
    """``load_reward_func(spec)``, its failures as :class:`RewardCheckError` naming the key and where modules are
    searched."""
    try:
        return load_reward_func(spec)
    except ModuleNotFoundError as e:
        raise RewardCheckError(
            f"{key}: reward function {spec!r}: cannot import module {e.name!r} ({e}). A 'module:function' is imported "
            f"from the working directory ({os.getcwd()}), the run file's directory (recipes/grpo.py) and PYTHONPATH; "
            f"built-in names are {sorted(BUILTIN)}") from e
    except (ValueError, TypeError) as e:
        raise RewardCheckError(f"{key}: {e}") from e
    except Exception as e:  # deliberate: the user's module raised while importing; say whose it is
        raise RewardCheckError(f"{key}: reward function {spec!r}: importing its module raised "
                               f"{type(e).__name__}: {e}") from e


def try_rewards(config: Any, sample: Any, *, key: str = "worker.reward", origin: str = "the prompts",
                answer_column: str = "answer") -> None:
    """Imports every reward function of ``config`` (a :class:`~asyncrl.config.RewardConfig`) and scores one
    completion of ``sample`` with the set, as a worker would.

    The completion's text is the sample's ``answer_column`` (a correct answer) if it has one, else empty; its token
    ids are empty (the trainer has no engine here).

    Args:
        config: the reward functions and weights.
        sample: one prompt item (the loader's first).
        key: the config key of ``config`` in messages (``rollout.worker.reward`` in a run file).
        origin: where ``sample`` came from, for messages (``data.path='math.jsonl', row 1``).
        answer_column: the column whose value stands in for the completion.

    Raises:
        RewardCheckError: a function that cannot be imported, is not callable, or raises or returns something other
            than one float (or None, or a dict with ``reward``) per completion on the sample.
    """
    loaded = [_load(spec, f"{key}.funcs") for spec in config.funcs]
    if isinstance(sample, dict):
        for column, who in reward_columns(config).items():
            if column not in sample:
                raise RewardCheckError(f"{key}: {who} reads column {column!r}, which the prompts do not have ({origin}: "
                                       f"its columns are {sorted(sample)}); add the column or fix the function")
    rewards = RewardSet([fn for _, fn in loaded], config.weights, [name for name, _ in loaded])
    answer = sample.get(answer_column) if isinstance(sample, dict) else None
    text = answer if isinstance(answer, str) else "" if answer is None else str(answer)
    completion = _sample_completion(sample, text)
    try:
        scored = rewards.score([(sample, [completion])])[0]
    except Exception as e:  # deliberate: anything a user's function does here is reported as its failure
        scored = RewardError(f"scoring raised {type(e).__name__}: {e}")
    finally:
        rewards.close()
    if isinstance(scored, RewardError):
        where = _where(scored.__cause__) if scored.__cause__ is not None else None
        cause = f" (at {where})" if where else ""
        raise RewardCheckError(
            f"{key}: tried on a sample before any worker started ({origin}, with the completion {text!r:.80}): "
            f"{scored}{cause}. Every worker would fail the same way on every group; fix the function (TRL's "
            "signature: f(prompts, completions, completion_ids, **columns) -> one float or None per completion)")


def _sample_completion(sample: Any, text: str) -> SampleCompletion:
    import torch

    ids = sample.get("prompt_ids") if isinstance(sample, dict) else None
    return SampleCompletion(text=text, prompt_ids=torch.tensor(ids or [], dtype=torch.long),
                            response_ids=torch.zeros(0, dtype=torch.long), logprobs=torch.zeros(0))


def _where(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback outside asyncrl (the user's function), if any."""
    package = str(Path(__file__).resolve().parents[1])
    tb, where = error.__traceback__, None
    while tb is not None:
        if not str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(package):
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def reward_columns(config: Any) -> dict[str, str]:
    """The dataset columns the reward functions of ``config`` require: each TRL-style function's keyword
    parameters without a default, besides ``prompts``, ``completions``, ``completion_ids`` and ``finish_reason``;
    ``{column: "the reward function 'name'"}``. Functions that cannot be imported are left to :func:`try_rewards`."""
    out: dict[str, str] = {}
    for spec in config.funcs:
        try:
            name, fn = load_reward_func(spec)
            params = inspect.signature(fn).parameters.values()
        except Exception:  # deliberate: try_rewards names the failure
            continue
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) == 2 and not any(p.kind is p.VAR_KEYWORD or p.name == "completion_ids" for p in params):
            continue  # a legacy (prompts, completions) function: it reads the items itself
        for p in params:
            if (p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in TRL_ARGUMENTS):
                out.setdefault(p.name, f"the reward function {name!r}")
    return out


def import_dirs(config: Any) -> list[str]:
    """The directories the reward functions' modules were imported from (importing them) that a fresh interpreter
    would not search: not the working directory, not on ``PYTHONPATH``, not inside the Python installation."""
    searched = {Path.cwd().resolve(), *(Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                        if p)}
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: list[str] = []
    for spec in config.funcs:
        module = spec.partition(":")[0]
        if spec in BUILTIN or ":" not in spec or module not in sys.modules and not _imports(module):
            continue
        root = _root(sys.modules[module])
        if root is None or root in searched or any(root.is_relative_to(p) for p in installed):
            continue
        if str(root) not in out:
            out.append(str(root))
    return out


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # deliberate: try_rewards names the failure
        return False
    return True


def _root(module: Any) -> Path | None:
    """The import-path directory ``module`` was found in (its file, up one level per dot of its name)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve().parent
    if Path(file).name == "__init__.py":
        path = path.parent
    for _ in range(module.__name__.count(".")):
        path = path.parent
    return path


def worker_env(config: Any) -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` for local workers that must import the reward modules the trainer imported from
    :func:`import_dirs` (the trainer's ``PYTHONPATH`` after them); ``{}`` when they need nothing."""
    dirs = import_dirs(config)
    if not dirs:
        return {}
    return {"PYTHONPATH": os.pathsep.join([*dirs, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
