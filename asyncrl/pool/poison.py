"""Poisoned prompts: prompts that every worker fails on, and what the pool does about them.

A worker that cannot finish a lease (the engine or the reward raised) reports it FAILED with the
error text. The ledger counts failed attempts per prompt and epoch (saved in its state, so a resume
keeps the count) and re-issues the prompt after a short, doubling backoff instead of at once, so a
prompt that always fails does not spin a worker. After ``max_prompt_failures`` failed attempts the
prompt is poisoned, and ``on_poisoned_prompt`` decides:

- ``"raise"``: the trainer's next ``take`` (``next(loader)``) raises :class:`PoisonedPromptError`
  naming the prompt, the count and the worker's last error. The prompt is parked, not re-issued; a
  resume from a checkpoint re-issues it once more (a fixed dataset or engine then goes on).
- ``"skip"``: the prompt is marked SKIPPED: it counts as done for the epoch's end but is never
  consumed, and the pool counts it in ``skipped_poisoned``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["PoisonPolicy", "PoisonedPromptError", "reissue_backoff_s"]

PoisonPolicy = Literal["raise", "skip"]

MAX_REISSUE_BACKOFF_S = 30.0
"""Longest wait before a failed prompt is leased again."""


class PoisonedPromptError(RuntimeError):
    """A prompt failed on workers ``failures`` times (``loader.max_prompt_failures``).

    Attributes:
        epoch: the prompt's epoch.
        prompt_index: the prompt's index in the dataset.
        failures: failed attempts counted this epoch.
        error: the worker's error text of the last failed attempt.
    """

    def __init__(self, epoch: int, prompt_index: int, failures: int, error: str):
        self.epoch, self.prompt_index, self.failures, self.error = epoch, prompt_index, failures, error
        super().__init__(
            f"prompt (epoch={epoch}, index={prompt_index}) failed on rollout workers {failures} times "
            f"(loader.max_prompt_failures); last error: {error}. Fix the prompt or the engine, or set "
            "loader.on_poisoned_prompt='skip' to skip such prompts (counted in stats()['pool']['skipped_poisoned'])"
        )

    def __reduce__(self):  # picklable across processes (torch.multiprocessing, Lightning's strategies)
        return type(self), (self.epoch, self.prompt_index, self.failures, self.error)


def reissue_backoff_s(failures: int, base_s: float) -> float:
    """Seconds to wait before leasing a prompt again after its ``failures``-th failed attempt."""
    if failures < 1 or base_s <= 0:
        return 0.0
    return min(base_s * 2.0 ** (failures - 1), MAX_REISSUE_BACKOFF_S)
