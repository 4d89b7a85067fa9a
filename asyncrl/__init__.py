"""asyncrl: a dataloader-native asynchronous rollout pipeline for RL post-training of LLMs.

The public surface: what a training loop uses (``recipes/grpo.py``, ``recipes/drop_in.py``) and every config
class. Each name is imported on first access, so ``import asyncrl`` stays light for worker processes and imports
neither ``workers`` nor ``datapipes`` (``RolloutLoader`` lives in ``datapipes``; it is loaded when asked for).

Where things live: ``asyncrl.config`` (every config class), ``asyncrl.pool`` (the buffer and what decides what
enters it), ``asyncrl.transport`` (the rollout channel), ``asyncrl.weights`` (weight sync), ``asyncrl.train``
(logprobs, losses, guard, policy sync), ``asyncrl.checkpoint``, ``asyncrl.data``, ``asyncrl.rewards``,
``asyncrl.models``; ``datapipes`` (the loader's torchdata nodes) and ``workers`` (the worker loop, engines).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_CONFIGS = ("CheckpointConfig", "ClusterConfig", "DataConfig", "DebugConfig", "EngineConfig", "FakeEngineConfig",
            "FleetConfig", "GangConfig", "GateConfig", "GuardConfig", "HFEngineConfig", "LoaderConfig", "LoraConfig", "LossConfig", "ModelConfig", "RecipeConfig",
            "RelayConfig", "RewardConfig", "SlurmConfig", "TrackingConfig", "TrainConfig", "TransportConfig", "VllmEngineConfig",
            "WeightSyncConfig", "WorkerConfig", "load_config")

_EXPORTS = {
    **{name: "asyncrl.config" for name in _CONFIGS},
    # the rollout side: what the loop iterates, and what it yields
    "RolloutLoader": "datapipes.loader",
    "collate_groups": "datapipes.collate",
    "Rollout": "asyncrl.rollout",
    "Group": "asyncrl.rollout",
    "DecodeError": "asyncrl.codec",
    "staleness": "asyncrl.pool.staleness",
    # what next(loader) raises besides StopIteration: a prompt every worker fails on, a worker that cannot start
    "PoisonedPromptError": "asyncrl.pool.poison",
    "WorkerStartError": "workers.launcher",
    # your data and rewards
    "load_prompts": "asyncrl.data.prompts",
    "render_prompt": "asyncrl.data.prompts",
    "RewardSet": "asyncrl.rewards.reward_set",
    "reward_weights": "asyncrl.rewards.reward_set",
    "component_means": "asyncrl.rewards.reward_set",
    # the model
    "load_causal_lm": "asyncrl.models.loading",
    "load_processor": "asyncrl.models.loading",
    "parallelize": "asyncrl.train.parallel",
    "adamw": "asyncrl.train.optim",
    # a training step
    "batch_logprobs": "asyncrl.train.logprobs",
    "batch_sampling": "asyncrl.train.logprobs",
    "token_logprobs": "asyncrl.train.logprobs",
    "compute_loss": "asyncrl.train.losses",
    "mismatch_metrics": "asyncrl.train.corrections",
    "ReferencePolicy": "asyncrl.train.reference",
    "UpdateGuard": "asyncrl.train.guard",
    "GuardVerdict": "asyncrl.train.guard",
    "PolicySync": "asyncrl.train.policy_sync",
    # weight sync
    "setup_weight_broadcaster": "asyncrl.weights",
    "setup_weight_receiver": "asyncrl.weights",
    "start_weight_sync": "asyncrl.weights.start",
    # checkpoints and the run directory
    "Checkpointer": "asyncrl.checkpoint.checkpointer",
    "hold_run_dir": "asyncrl.checkpoint.run_dir",
    "continue_records": "asyncrl.checkpoint.run_dir",
    "record_files": "asyncrl.checkpoint.run_dir",
    "RunDirLocked": "asyncrl.checkpoint.run_dir",
    # the RL debugger
    "Debugger": "asyncrl.debug.detectors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]
