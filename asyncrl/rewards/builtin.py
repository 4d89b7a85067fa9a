"""The built-in reward functions (``reward.funcs`` names in :data:`asyncrl.rewards.BUILTIN`), TRL's signature.

Each takes the completions (a str, or TRL's conversational ``[{"role": "assistant", "content": ...}]``) and
the prompt columns it needs as keywords, and ignores the rest (``**kwargs``): ``math_reward`` (``math-verify``
against ``answer`` or TRL's ``solution``), ``format_reward`` (``<think>...</think><answer>...</answer>``; any
pattern with :func:`make_format_reward`), ``reasoning_gym_reward`` (the task's own ``score_answer`` from
``metadata["source_dataset"]``), ``arithmetic_reward`` (the embedded task), ``visual_reward`` (the visual tasks)
and ``fake_reward`` (the fake engine).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "THINK_ANSWER",
    "arithmetic_reward",
    "completion_text",
    "fake_reward",
    "format_reward",
    "make_format_reward",
    "math_reward",
    "reasoning_gym_reward",
    "visual_reward",
]




def completion_text(completion: Any) -> str:
    """The text of a completion in either TRL form: a str, or ``[{"role": "assistant", "content": text}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a str or a list of messages, got {completion!r:.100}")


def math_reward(completions: Sequence[Any], answer: Sequence[Any] | None = None,
                solution: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 if ``math-verify`` finds the completion's answer equal to the prompt's ``answer`` (or TRL's
    ``solution``) column, else 0.0; None (unscored) when the reference answer does not parse."""
    from math_verify import parse, verify

    gold_column = answer if answer is not None else solution
    if gold_column is None:
        raise ValueError("math_reward needs an 'answer' (or 'solution') column in the prompts")
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (5, 5) if main else (None, None)
    out: list[float | None] = []
    for completion, gold in zip(completions, gold_column):
        gold_parsed = parse(str(gold), parsing_timeout=parse_timeout)
        if not gold_parsed:
            out.append(None)
            continue
        guess = parse(completion_text(completion), parsing_timeout=parse_timeout)
        out.append(float(verify(gold_parsed, guess, timeout_seconds=verify_timeout)))
    return out


THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
"""The format reward's default pattern: reasoning in ``<think>``, then the answer in ``<answer>``."""


def make_format_reward(pattern: str, name: str = "format") -> Callable[..., list[float]]:
    """A reward function scoring 1.0 for completions that match ``pattern`` (``re.DOTALL``), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [1.0 if regex.match(completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name
    return reward


format_reward = make_format_reward(THINK_ANSWER, "format_reward")
format_reward.__doc__ = f"1.0 for ``<think>...</think><answer>...</answer>`` completions (``{THINK_ANSWER}``), else 0."


def reasoning_gym_reward(completions: Sequence[Any], metadata: Sequence[dict[str, Any]] | None = None,
                         answer: Sequence[Any] | None = None, question: Sequence[Any] | None = None,
                         **kwargs: Any) -> list[float]:
    """reasoning-gym's own ``score_answer`` of the task named in each prompt's ``metadata["source_dataset"]``.

    The answer scored is the last ``<answer>...</answer>`` of the completion if it has one (reasoning-gym's
    convention), else the whole completion stripped. The entry scored against is rebuilt from the prompt's
    ``question``, ``answer`` and ``metadata`` columns, as reasoning-gym's datasets yield it.
    """
    from reasoning_gym import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    if metadata is None:
        raise ValueError("reasoning_gym_reward needs a 'metadata' column (reasoning-gym's entry metadata)")
    out = []
    for i, (completion, meta) in enumerate(zip(completions, metadata)):
        if not isinstance(meta, dict) or "source_dataset" not in meta:
            raise ValueError(f"reasoning_gym_reward: metadata must name its 'source_dataset', got {meta!r:.200}")
        text = completion_text(completion)
        guess = extract_answer(text)
        entry = {"question": question[i] if question else None, "answer": answer[i] if answer else None,
                 "metadata": meta}
        out.append(float(get_score_answer_fn(meta["source_dataset"])(guess if guess is not None else text.strip(),
                                                                    entry)))
    return out


def arithmetic_reward(completions: Sequence[Any], answer: Sequence[Any], finish_reason: Sequence[str] | None = None,
                      **kwargs: Any) -> list[dict[str, float]]:
    """The embedded task's reward (``asyncrl.data.tasks``): 1 for the exact answer, partial credit for a correct prefix.

    ``reward = exact + 0.5 * (1 - exact) * prefix``, where ``prefix`` is the fraction of the answer's characters
    the response starts with; components ``exact``, ``prefix`` and ``stopped`` (1 when the response ended by itself).
    """
    return _answer_match(completions, answer, finish_reason)


def visual_reward(completions: Sequence[Any], answer: Sequence[Any], finish_reason: Sequence[str] | None = None,
                  **kwargs: Any) -> list[dict[str, float]]:
    """The visual tasks' reward (``asyncrl.data.visual_task``: a count digit, a colour word): the response against the
    answer word, scored as :func:`arithmetic_reward` scores a sum (exact, with partial credit for a correct prefix;
    components ``exact``, ``prefix``, ``stopped``)."""
    return _answer_match(completions, answer, finish_reason)


def _answer_match(completions: Sequence[Any], answer: Sequence[Any],
                  finish_reason: Sequence[str] | None) -> list[dict[str, float]]:
    out = []
    for i, (completion, gold) in enumerate(zip(completions, answer)):
        gold, text = str(gold), completion_text(completion).strip()
        exact = float(text == gold)
        prefix = 0
        while prefix < min(len(text), len(gold)) and text[prefix] == gold[prefix]:
            prefix += 1
        partial = prefix / max(len(gold), 1)
        stopped = float(finish_reason is not None and finish_reason[i] == "stop")
        out.append({"reward": exact + 0.5 * (1 - exact) * partial, "exact": exact, "prefix": partial,
                    "stopped": stopped})
    return out


def fake_reward(completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[dict[str, float]]:
    """Deterministic reward for the fake engine: the fraction of even token ids, plus a ``length`` component."""
    out = []
    for ids in completion_ids:
        even = sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)
        out.append({"reward": even, "even_fraction": even, "length": float(len(ids))})
    return out
