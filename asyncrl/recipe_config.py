"""The GRPO recipe's run file: one section per component, as ``recipes/configs/*.yaml`` spell them.

``recipes/grpo.py`` reads a :class:`RecipeConfig` (:func:`load_config`: a YAML file plus dotted ``key=value``
overrides, unknown keys refused) and writes it as ``config.json`` into the run directory and every checkpoint;
``asyncrl.debug.rejection`` reads those back to replay a rejected batch. The sections of other components
(``data``, ``loss``, ``reward``, ``guard``, ``weights``, ``rollout``, ``debug``) are their modules' own config
classes; the ones defined here belong to the recipe's own loop (model, optimizer schedule, LoRA, checkpoints).
Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.checkpoint import SAVE_POINTS
from asyncrl.config import LoaderConfig, RewardConfig, WeightSyncConfig, load_run_file
from asyncrl.data import DataConfig
from asyncrl.debug.detectors import DebugConfig
from asyncrl.guard import GuardConfig
from asyncrl.losses import LossConfig

__all__ = ["CheckpointConfig", "LoraSettings", "ModelConfig", "RecipeConfig", "TrainConfig", "load_config"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy the trainer starts from (and every engine loads)."""

    path: str | None = None
    """HF model directory; None builds the tiny embedded model into ``{run_dir}/model`` (the tiny vision-language
    model of ``workers.tiny_vlm`` for ``data.source=visual_count`` or ``visual_colour``)."""
    dtype: str = "float32"
    """torch dtype name of the trainer's parameters and every engine's (``rollout.worker.engine.dtype``)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The trainer's loop: steps, AdamW, the supervised warm start, parallelism, fault injection."""

    steps: int = 100
    """Optimizer steps (accepted or rejected) of the whole run, across epochs."""
    lr: float = 1e-3
    """AdamW learning rate after the warm-up."""
    warmup_steps: int = 10
    """Linear learning-rate warm-up (a function of the step alone, so resume needs no scheduler state)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradients are clipped to this global norm (asyncrl.guard, over all ranks)."""
    sft_steps: int = 0
    """Supervised warm-start steps on the task's answers before RL (fresh runs only)."""
    sft_lr: float = 3e-3
    """The warm start's learning rate (its own AdamW, discarded afterwards)."""
    sft_batch: int = 64
    """Prompts per warm-start step, per rank."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How ranks share the policy: DDP replicas or FSDP2 shards (asyncrl.parallel)."""
    seed: int = 0
    """Seeds torch (every rank alike) and the tiny model; the warm start's draws add ``1000 * rank``."""
    threads: int | None = None
    """torch intra-op threads per rank; None: the cores left after the local workers, per local rank
    (asyncrl.threads: more threads than cores made a 2-core trainer step 15x slower)."""
    pause_after_step: int | None = None
    """Fault injection for tests: every rank sleeps after logging this step (to be killed mid-run)."""
    pause_in_save_at_step: int | None = None
    """Fault injection for tests: rank 0 sleeps inside the save of this step, after ``pause_in_save_point``
    (the other ranks wait at the save's last barrier), to be killed in the middle of a save."""
    pause_in_save_point: str = "renamed"
    """One of ``asyncrl.checkpoint.SAVE_POINTS``: "staged", "marked", "renamed" (the new step-N exists, latest
    still names the previous one), "pointed", "pruned"."""

    def __post_init__(self) -> None:
        if self.pause_in_save_point not in SAVE_POINTS:
            raise ValueError(f"train.pause_in_save_point={self.pause_in_save_point!r} must be one of {SAVE_POINTS}")


@dataclass(kw_only=True, slots=True)
class LoraSettings:
    """A LoRA adapter (peft) on a frozen base instead of full fine-tuning."""

    rank: int = 0
    """> 0 trains a LoRA adapter only and syncs only the adapter to workers."""
    alpha: int = 16
    """LoRA scaling numerator (peft's ``lora_alpha``)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""
    qlora: bool = False
    """QLoRA: the trainer's base and every HF rollout engine's load in 4-bit NF4 (:mod:`asyncrl.qlora`, bitsandbytes;
    the engines through ``engine.quantization=nf4``), the adapter trains in full precision, only the adapter is
    synced, and checkpoints hold the adapter and its optimizer state with the base referenced by hash. Needs
    ``rank > 0``, ``train.parallel=ddp`` and HF engines."""

    def __post_init__(self) -> None:
        if self.qlora and self.rank <= 0:
            raise ValueError(f"lora.qlora=true needs lora.rank > 0 (the adapter QLoRA trains), got lora.rank={self.rank}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When the recipe saves (asyncrl.checkpoint.Checkpointer) and how many it keeps."""

    every: int = 20
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Complete checkpoints kept (besides whatever ``latest`` names, never deleted); 0 keeps all."""


@dataclass(kw_only=True, slots=True)
class RecipeConfig:
    """A whole run of ``recipes/grpo.py``."""

    run_dir: str = "runs/grpo"
    """Everything the run writes (metrics, checkpoints, dumps, report); held by one run at a time."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reward: RewardConfig | None = None
    """``reward.funcs`` / ``reward.weights`` (asyncrl.rewards); None: ``rollout.worker.reward``."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    weights: WeightSyncConfig = field(default_factory=lambda: WeightSyncConfig(type="shm"))
    rollout: LoaderConfig = field(default_factory=LoaderConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        if self.lora.qlora:  # refused here, before any process starts, with the reason
            from asyncrl.qlora import FSDP2_REFUSAL, VLLM_REFUSAL

            if self.train.parallel != "ddp":
                raise ValueError(f"lora.qlora=true with train.parallel={self.train.parallel}: {FSDP2_REFUSAL}")
            if self.rollout.worker.engine.type == "vllm":
                raise ValueError(f"lora.qlora=true with rollout.worker.engine.type=vllm: {VLLM_REFUSAL}")


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """A YAML run file plus dotted ``key=value`` overrides (values parsed as YAML)."""
    return load_run_file(RecipeConfig, path, overrides)

