"""Renamed and removed configuration keys, in one table, so an old run file fails with the key to use instead.

:func:`asyncrl.config.from_dict` looks every key it does not know up here (by the class that would hold it) and
raises with the new name. A reward function spec that moved is refused by :class:`~asyncrl.config.RewardConfig`
with its new spelling (:data:`MOVED_REWARDS`).
"""

from __future__ import annotations

__all__ = ["MOVED_REWARDS", "RENAMED", "renamed"]

RENAMED: dict[tuple[str, str], str] = {
    # loss: TRL's names replaced asyncrl's first ones
    ("LossConfig", "clip_low"): "loss.epsilon",
    ("LossConfig", "clip_high"): "loss.epsilon_high",
    ("LossConfig", "kl_coef"): "loss.beta",
    ("LossConfig", "aggregation"): "loss.loss_type (aggregation: token is loss_type: bnpo, sequence is grpo)",
    # the reward has one home: the worker that scores
    ("RecipeConfig", "reward"): "rollout.worker.reward",
    # test-only knobs live in the testing section
    ("TrainConfig", "pause_after_step"): "testing.pause_after_step",
    ("TrainConfig", "pause_in_save_at_step"): "testing.pause_in_save_at_step",
    ("TrainConfig", "pause_in_save_point"): "testing.pause_in_save_point",
    ("GuardConfig", "inject_nan_at_step"): "testing.inject_nan_at_step",
    ("WorkerConfig", "fault"): "testing.worker_fault (WorkerConfig.testing.worker_fault in code)",
}
"""``(config class, old key) -> what to write instead`` (a dotted key from the run file's root)."""

MOVED_REWARDS: dict[str, str] = {
    "workers.rewards:arithmetic_reward": "arithmetic",
    "workers.rewards:fake_reward": "fake",
}
"""Reward function specs of modules that moved -> the built-in name that scores the same."""


def renamed(cls_name: str, key: str) -> str | None:
    """What replaced ``key`` of config class ``cls_name``, or None if it was never a key."""
    return RENAMED.get((cls_name, key))
