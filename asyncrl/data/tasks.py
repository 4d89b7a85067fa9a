"""The embedded task: short arithmetic the tiny model can learn on CPU in minutes.

A prompt is ``{"text": "12+7=", "answer": "19"}``; the policy should answer with the digits and
stop. :func:`asyncrl.rewards.legacy.arithmetic_reward` scores it.
"""

from __future__ import annotations

import random

__all__ = ["arithmetic_prompts"]


def arithmetic_prompts(n: int, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict[str, str]]:
    """``n`` deterministic arithmetic prompts with their answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"text": f"{a}{op}{b}=", "answer": str(value)})
    return out
