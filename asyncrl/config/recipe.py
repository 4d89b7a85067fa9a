"""The GRPO recipe's run file: one section per component, as ``recipes/configs/*.yaml`` spell them.

``recipes/grpo.py`` reads a :class:`RecipeConfig` (:func:`load_config`: a YAML file plus dotted ``KEY=VALUE``
overrides, unknown keys refused, renamed ones with their new name) and writes it as ``config.json`` into the run
directory and every checkpoint; ``asyncrl.debug.rejection`` reads those back to replay a rejected batch.

::

    run_dir
    model       ModelConfig        the policy every process loads
    data        DataConfig         the prompts
    train       TrainConfig        steps, AdamW, warm start, DDP/FSDP2
    loss        LossConfig         the GRPO family and its off-policy corrections
    guard       GuardConfig        which updates are rejected
    lora        LoraConfig         an adapter (or QLoRA) instead of full fine-tuning
    checkpoint  CheckpointConfig   when to save, how many to keep
    weights     WeightSyncConfig   the trainer -> workers weight channel
    rollout     LoaderConfig       the rollout side: pool, channel, gate, workers (their engine and reward)
    debug       DebugConfig        the RL debugger, samples of completions
    report_to   list[str]          TRL's key: the experiment trackers (tensorboard, wandb, mlflow)
    tracking    TrackingConfig     where those trackers write
    cluster     ClusterConfig      where the processes run: this machine (torchrun), a Ray cluster, Slurm
    testing     TestingConfig      fault injection for the project's tests only

``rollout`` is the :class:`~asyncrl.config.LoaderConfig` because the loader owns the whole rollout side of a rank:
its pool, its channel and the local workers it starts; ``rollout.max_staleness`` is the one knob of the regime.
The reward lives in ``rollout.worker.reward``, where the workers that score read it. Plain data: nothing here
blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config._load import load_run_file
from asyncrl.config.cluster import ClusterConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.debug import DebugConfig
from asyncrl.config.loader import LoaderConfig
from asyncrl.config.testing import TestingConfig
from asyncrl.config.tracking import TrackingConfig, normalize_report_to
from asyncrl.config.train import (
    FSDP2_REFUSAL,
    VLLM_REFUSAL,
    CheckpointConfig,
    GuardConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    TrainConfig,
)
from asyncrl.config.weights import WeightSyncConfig

__all__ = ["RecipeConfig", "load_config"]


@dataclass(kw_only=True, slots=True)
class RecipeConfig:
    """A whole run of ``recipes/grpo.py``."""

    run_dir: str = "runs/grpo"
    """Everything the run writes (metrics, checkpoints, dumps, report); held by one run at a time."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    weights: WeightSyncConfig = field(default_factory=lambda: WeightSyncConfig(type="shm"))
    rollout: LoaderConfig = field(default_factory=LoaderConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    report_to: list[str] | str = field(default_factory=list)
    """TRL's ``report_to``: the experiment trackers rank 0 logs to, any of ``tensorboard``, ``wandb``, ``mlflow``
    (each an extra: ``pip install 'asyncrl[wandb]'``), ``"all"`` (those installed) or ``"none"``. They get each step's
    metrics and the guard's verdict, the resolved config, the samples as tables and the end-of-run summary; a
    ``--resume`` continues the same tracker run (``asyncrl.integrations.trackers``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where the run's processes go (``asyncrl launch``): ``local`` (``torchrun`` here, as always), ``ray`` or
    ``slurm``. The recipe itself reads only ``engine``: beyond ``local`` each rank writes its pool's record (endpoint,
    CURVE public key, weight address) for the workers to find (:mod:`asyncrl.cluster.registry`)."""
    testing: TestingConfig = field(default_factory=TestingConfig)
    """Fault injection for the project's tests (never set in a real run)."""

    def __post_init__(self) -> None:
        self.report_to = normalize_report_to(self.report_to)
        if self.rollout.group_size < 2 and self.loss.fn is None:  # refused here, before any process starts
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GRPO's advantage is a rollout's reward minus its "
                "group's mean, 0 in a group of one, so every step would train with loss and gradient 0. Set "
                "rollout.group_size to 2 or more (8-16 is usual), or give a loss.fn of your own")
        engine, rollout = self.rollout.worker.engine.type, self.rollout
        if self.weights.type == "none" and engine in ("hf", "vllm") and rollout.max_staleness is not None and not (
                rollout.frozen_workers):  # the recipe hands `weights` to the workers: they would never be updated
            raise ValueError(
                f"weights.type='none' with rollout.worker.engine.type={engine}: the workers would never get the "
                f"trainer's weights, and once its policy version passes rollout.max_staleness={rollout.max_staleness} "
                "every group they make would be dropped as stale. Use weights.type=shm (one machine; the default), "
                "zmq, nccl or cuda_ipc")
        if self.lora.qlora:  # refused here, before any process starts, with the reason
            if self.train.parallel != "ddp":
                raise ValueError(f"lora.qlora=true with train.parallel={self.train.parallel}: {FSDP2_REFUSAL}")
            if self.rollout.worker.engine.type == "vllm":
                raise ValueError(f"lora.qlora=true with rollout.worker.engine.type=vllm: {VLLM_REFUSAL}")


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """A YAML run file plus dotted ``KEY=VALUE`` overrides (values parsed as YAML)."""
    return load_run_file(RecipeConfig, path, overrides)
