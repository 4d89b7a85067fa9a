"""asyncrl: a dataloader-native asynchronous rollout pipeline for RL post-training of LLMs.

The public surface. Heavy or cross-package names (``RolloutLoader`` lives in ``datapipes``) are
imported on first access, so ``import asyncrl`` stays light for worker processes.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DecodeError": "asyncrl.codec",
    "EngineConfig": "asyncrl.config",
    "GateConfig": "asyncrl.config",
    "Group": "asyncrl.rollout",
    "LoaderConfig": "asyncrl.config",
    "LossConfig": "asyncrl.losses",
    "ReferencePolicy": "asyncrl.reference",
    "RewardConfig": "asyncrl.config",
    "RewardSet": "asyncrl.rewards",
    "compute_loss": "asyncrl.losses",
    "PromptLedger": "asyncrl.ledger",
    "Rollout": "asyncrl.rollout",
    "RolloutLoader": "datapipes.loader",
    "RolloutPool": "asyncrl.pool",
    "TransportConfig": "asyncrl.config",
    "WeightSyncConfig": "asyncrl.config",
    "WorkerConfig": "asyncrl.config",
    "setup_weight_broadcaster": "asyncrl.weights",
    "setup_weight_receiver": "asyncrl.weights",
    "collate_groups": "datapipes.collate",
    "is_stale": "asyncrl.staleness",
    "staleness": "asyncrl.staleness",
    "Timeline": "asyncrl.timeline",
    "new_incarnation": "asyncrl.timeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]
