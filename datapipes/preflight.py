"""What a :class:`~datapipes.loader.RolloutLoader` checks before it opens a socket or starts a worker: every mistake
its config and prompts show, named where it is made with the fix, instead of a hang, a silent no-op or the same
error in every worker.

::

    RolloutLoader.__init__ ──► check_loader(config, prompts, shard_size, key) ──► the workers' extra environment
        batch_size larger than this rank's shard of prompts             (every batch would be smaller than asked)
        local workers (num_workers > 0) of an engine with weights (hf, vllm):
            no weight channel while the policy version moves             (their groups all go stale: a hang)
            engine.model not a model                                     (asyncrl.models.check_model_dir)
        local workers: worker.environment importable; the reward functions imported and tried on prompts[0]
                       (asyncrl.rewards.preflight), and the directories they came from put on the workers' PYTHONPATH

Workers started elsewhere (``num_workers=0``) bring their own config: only the batch is checked. Nothing here blocks
but the reward functions' one call and the imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from asyncrl.config import LoaderConfig
from asyncrl.models.loading import check_model_dir
from asyncrl.rewards.preflight import try_rewards, worker_env

__all__ = ["check_loader"]

REAL_ENGINES = ("hf", "vllm")
"""Engines whose rollouts come from weights the trainer must send them (the fake one follows the pool's version)."""


def check_loader(config: LoaderConfig, prompts: Sequence[Any], *, shard_size: int, world_size: int,
                 key: str = "LoaderConfig") -> dict[str, str]:
    """Refuses a loader that cannot work (see the module docstring); returns the environment its local workers need.

    Args:
        config: the loader's settings.
        prompts: its dataset.
        shard_size: prompts in this rank's shard.
        world_size: trainer ranks.
        key: how messages name the settings (``LoaderConfig``, a run file's ``rollout``).

    Raises:
        ValueError: naming the setting and the fix (:class:`~asyncrl.models.ModelDirError` and
            :class:`~asyncrl.rewards.preflight.RewardCheckError` for a model or a reward).
    """
    if config.batch_size > shard_size:
        raise ValueError(
            f"{key}.batch_size={config.batch_size} groups is more than this rank's shard of the prompts: "
            f"{shard_size} ({len(prompts)} prompts over {world_size} rank{'s' if world_size > 1 else ''}), so every "
            f"batch would hold at most {shard_size} groups. Lower {key}.batch_size or give more prompts")
    if config.num_workers == 0:
        return {}
    worker, where = config.worker, f"{key}.worker"
    if worker.engine.type in REAL_ENGINES:
        if worker.weights.type == "none" and config.max_staleness is not None and not config.frozen_workers:
            raise ValueError(
                f"{where}.engine.type={worker.engine.type!r} with {where}.weights.type='none': the local workers can "
                "never receive the trainer's weights, so once the trainer's policy version passes "
                f"{key}.max_staleness={config.max_staleness} every group they make is dropped as stale and next() "
                "waits for ever. Give the workers a weight channel (weights = setup_weight_broadcaster('shm', ...); "
                f"{where}.weights=WeightSyncConfig(type='shm', address=weights.address); PolicySync publishes to it), "
                f"or set {key}.max_staleness=None (train on rollouts of the initial weights however stale), or "
                f"{key}.frozen_workers=True (a loop that never moves the policy version)")
        check_model_dir(worker.engine.model, key=f"{where}.engine.model")
    if worker.environment:
        _check_import(worker.environment, f"{where}.environment")
        return {}  # an environment's step rewards replace the reward functions
    origin = getattr(prompts, "origin", "the prompts")
    try_rewards(worker.reward, prompts[0], key=f"{where}.reward", origin=f"{origin}, the first prompt")
    return worker_env(worker.reward)


def _check_import(spec: str, key: str) -> None:
    module, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr, None) if attr else None
    except Exception as e:  # deliberate: the user's module failed to import; say which setting names it
        raise ValueError(f"{key}={spec!r}: importing {module!r} raised {type(e).__name__}: {e}") from e
    if found is None:
        raise ValueError(f"{key}={spec!r} must be 'module:Class' of an importable module with that class")
