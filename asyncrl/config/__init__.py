"""Every configuration class, one import point: ``from asyncrl.config import LoaderConfig, HFEngineConfig, ...``.

One dataclass per component (``@dataclass(kw_only=True, slots=True)``, a docstring under each field, cross-field
checks in ``__post_init__`` raising with the fix), grouped by the section of a run file that holds it:

============================  ===================================  =========================================
module                        classes                              run file section
============================  ===================================  =========================================
:mod:`~.loader`               ``LoaderConfig``, ``GateConfig``     ``rollout``, ``rollout.gate``
:mod:`~.transport`            ``TransportConfig``                  ``rollout.transport``
:mod:`~.worker`               ``WorkerConfig``, ``RewardConfig``   ``rollout.worker``, ``rollout.worker.reward``
:mod:`~.engine`               ``EngineConfig`` and its ``type``s   ``rollout.worker.engine``
:mod:`~.weights`              ``WeightSyncConfig``,                ``weights`` (and ``rollout.worker.weights``),
                              ``RelayConfig``                      ``relay`` (``asyncrl relay``)
:mod:`~.data`                 ``DataConfig``                       ``data``
:mod:`~.train`                ``ModelConfig``, ``TrainConfig``,    ``model``, ``train``, ``loss``, ``guard``,
                              ``LossConfig``, ``GuardConfig``,     ``lora``, ``checkpoint``
                              ``LoraConfig``, ``CheckpointConfig``
:mod:`~.debug`                ``DebugConfig``                      ``debug``
:mod:`~.tracking`             ``TrackingConfig``                   ``tracking`` (and ``report_to``)
:mod:`~.testing`              ``TestingConfig``, ``FaultConfig``   ``testing`` (the project's tests only)
:mod:`~.cluster`              ``ClusterConfig``, ``GangConfig``,   ``cluster`` (``asyncrl launch``)
                              ``FleetConfig``, ``SlurmConfig``
:mod:`~.recipe`               ``RecipeConfig``                     the whole run file of ``recipes/grpo.py``
============================  ===================================  =========================================

Configs are plain data so they travel as JSON to worker processes and load from files: :func:`from_dict` (unknown
keys refused with the closest known one, :func:`check_keys`; renamed ones with their new name: :mod:`~.renames`),
:func:`to_dict`, :func:`load_run_file` and :func:`apply_overrides` (dotted ``KEY=VALUE``, YAML values: the one
override grammar).
"""

from asyncrl.config._load import apply_overrides, check_keys, from_dict, load_run_file, to_dict
from asyncrl.config.cluster import ClusterConfig, FleetConfig, GangConfig, SlurmConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.debug import DebugConfig
from asyncrl.config.engine import EngineConfig, FakeEngineConfig, HFEngineConfig, ModelEngineConfig, VllmEngineConfig
from asyncrl.config.loader import GateConfig, LoaderConfig
from asyncrl.config.recipe import RecipeConfig, load_config
from asyncrl.config.testing import FaultConfig, TestingConfig
from asyncrl.config.tracking import TrackingConfig
from asyncrl.config.train import CheckpointConfig, GuardConfig, LoraConfig, LossConfig, ModelConfig, TrainConfig
from asyncrl.config.transport import TransportConfig
from asyncrl.config.weights import RelayConfig, WeightSyncConfig
from asyncrl.config.worker import RewardConfig, WorkerConfig

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DebugConfig",
    "EngineConfig",
    "FakeEngineConfig",
    "FaultConfig",
    "FleetConfig",
    "GangConfig",
    "GateConfig",
    "GuardConfig",
    "HFEngineConfig",
    "LoaderConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "ModelEngineConfig",
    "RecipeConfig",
    "RelayConfig",
    "RewardConfig",
    "SlurmConfig",
    "TestingConfig",
    "TrackingConfig",
    "TrainConfig",
    "TransportConfig",
    "VllmEngineConfig",
    "WeightSyncConfig",
    "WorkerConfig",
    "apply_overrides",
    "check_keys",
    "from_dict",
    "load_config",
    "load_run_file",
    "to_dict",
]
