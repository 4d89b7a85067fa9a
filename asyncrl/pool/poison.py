"""Poisoned prompts: prompts that every worker fails on, and what the pool does about them.

A worker that cannot finish a lease (the engine or the reward raised) reports it FAILED with the
error text and what failed (its ``culprit``). The ledger counts failed attempts per prompt and epoch (saved
in its state, so a resume keeps the count) and re-issues the prompt after a short, doubling backoff instead
of at once, so a prompt that always fails does not spin a worker. After ``max_prompt_failures`` failed attempts the
prompt is poisoned, and ``on_poisoned_prompt`` decides:

- ``"raise"``: the trainer's next ``take`` (``next(loader)``) raises :class:`PoisonedPromptError`
  naming the prompt, the count, what failed (the FAILED report's ``culprit``: the reward, the engine, decoding, the
  environment; :data:`CULPRITS`), the worker's last error and the setting that skips such prompts, as the loader's
  settings are named where it was built (``LoaderConfig.on_poisoned_prompt``, a run file's
  ``rollout.on_poisoned_prompt``). The prompt is parked, not re-issued; a resume from a checkpoint re-issues
  it once more (a fixed dataset or engine then goes on).
- ``"skip"``: the prompt is marked SKIPPED: it counts as done for the epoch's end but is never
  consumed, and the pool counts it in ``skipped_poisoned``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CULPRITS", "PoisonPolicy", "PoisonedPromptError", "reissue_backoff_s"]

PoisonPolicy = Literal["raise", "skip"]

MAX_REISSUE_BACKOFF_S = 30.0
"""Longest wait before a failed prompt is leased again."""


CULPRITS: dict[str, str] = {
    "reward": "a reward function raised (or returned something other than one float or None per completion) on this "
              "prompt's completions: fix the function, or the prompt's columns it reads",
    "engine": "the engine failed to generate for this prompt: check the prompt (its length against the engine's "
              "max_model_len, its token ids) and the engine's settings",
    "decode": "turning the completions' token ids into text failed: check the model's tokenizer",
    "environment": "the environment raised during this prompt's episode: fix the environment",
    "worker": "the worker failed around the generation (see the error)",
}
"""What the worker's FAILED report blames (its ``culprit``) -> what to fix."""


class PoisonedPromptError(RuntimeError):
    """A prompt failed on workers ``failures`` times (``max_prompt_failures``).

    Attributes:
        epoch: the prompt's epoch.
        prompt_index: the prompt's index in the dataset.
        failures: failed attempts counted this epoch.
        error: the worker's error text of the last failed attempt.
        culprit: what failed in the worker (a key of :data:`CULPRITS`, or ``"unknown"``).
        config_key: how the message names the loader's settings: ``LoaderConfig`` (the class, for a library user)
            or a run file's section (``rollout`` in ``recipes/grpo.py``).
    """

    def __init__(self, epoch: int, prompt_index: int, failures: int, error: str, culprit: str = "unknown",
                 config_key: str = "LoaderConfig"):
        self.epoch, self.prompt_index, self.failures, self.error = epoch, prompt_index, failures, error
        self.culprit, self.config_key = culprit, config_key
        blame = CULPRITS.get(culprit, "the worker's report does not say what failed")
        skip = (f"{config_key}.on_poisoned_prompt='skip'" if config_key == "LoaderConfig"
                else f"{config_key}.on_poisoned_prompt=skip")
        super().__init__(
            f"prompt (epoch={epoch}, index={prompt_index}) failed on rollout workers {failures} times "
            f"({config_key}.max_prompt_failures): {blame}. Last error: {error}. Or set {skip} to skip such prompts "
            "(counted in stats()['pool']['skipped_poisoned'])"
        )

    def __reduce__(self):  # picklable across processes (torch.multiprocessing, Lightning's strategies)
        return type(self), (self.epoch, self.prompt_index, self.failures, self.error, self.culprit, self.config_key)


def reissue_backoff_s(failures: int, base_s: float) -> float:
    """Seconds to wait before leasing a prompt again after its ``failures``-th failed attempt."""
    if failures < 1 or base_s <= 0:
        return 0.0
    return min(base_s * 2.0 ** (failures - 1), MAX_REISSUE_BACKOFF_S)
