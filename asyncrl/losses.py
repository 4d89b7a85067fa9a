"""GRPO advantages, the clipped policy loss with off-policy corrections, and train/inference mismatch metrics.

All functions take tensors laid out like ``datapipes.collate.collate_groups``: ``[B, L]`` per-token values
aligned to ``input_ids`` and a boolean ``loss_mask`` that is True at generated response tokens. Values
outside the mask may be anything, ``-inf`` included (``asyncrl.logprobs.token_logprobs`` puts ``-inf`` at
prompt tokens outside top-k/top-p), so masks are applied with ``torch.where`` and never by multiplying.

Three log-probabilities meet in :func:`policy_loss`:

* ``logprobs`` -- the policy being optimised (carries the graph);
* ``old_logprobs`` -- the trainer's policy before this update, the *proximal* policy of decoupled PPO
  (``logprobs.detach()`` when a batch gets a single optimizer step);
* ``rollout_logprobs`` -- the *behaviour* policy as the engine sampled it (a stale policy version and a
  different numeric stack: the train/inference mismatch that ``correction`` compensates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["LossConfig", "group_advantages", "mismatch_metrics", "policy_loss"]

MISMATCH_RATIO_BOUNDS = (1.5, 2.0, 5.0, 10.0)
"""``mismatch_metrics`` reports the fraction of IS ratios outside ``[1/c, c]`` for each ``c`` here."""


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by the group's std.

    Args:
        rewards: ``[B]`` scalar rewards.
        group_index: ``[B]`` integer group of each row (any ids; rows need not be consecutive).
        normalize_std: divide by the group's population std (``unbiased=False``) plus ``eps``.
        eps: > 0; keeps a group whose rewards are all equal at advantage 0 instead of NaN.

    Returns:
        float ``[B]`` advantages (float32 unless ``rewards`` is another floating dtype).

    Raises:
        ValueError: on mismatched shapes or ``eps <= 0``.
    """
    if rewards.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(f"need 1-D rewards and group_index of one shape, got {rewards.shape=} {group_index.shape=}")
    if normalize_std and eps <= 0:
        raise ValueError(f"{eps=} must be > 0 when normalize_std=True")
    values = rewards if rewards.is_floating_point() else rewards.float()
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts = counts.to(values.dtype)
    mean = torch.zeros_like(counts).index_add_(0, inverse, values) / counts
    centered = values - mean[inverse]
    if not normalize_std:
        return centered
    var = torch.zeros_like(counts).index_add_(0, inverse, centered.square()) / counts
    return centered / (var.sqrt()[inverse] + eps)


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The clipped policy-gradient loss and how it corrects for off-policy rollouts."""

    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low``; in [0, 1)."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high``; >= 0 (DAPO's clip-higher uses e.g. 0.28)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimator to a reference policy; > 0 needs ``ref_logprobs``."""
    aggregation: Literal["token", "sequence"] = "token"
    """``token``: mean over every valid token of the batch (long responses weigh more); ``sequence``: mean
    over sequences of each sequence's token mean (sequences with no valid token are left out)."""
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
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(f"need 0 <= {self.clip_low=} < 1 and {self.clip_high=} >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"{self.kl_coef=} must be >= 0")
        if self.aggregation not in ("token", "sequence"):
            raise ValueError(f"loss.aggregation={self.aggregation!r} must be 'token' or 'sequence'")
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


def _aggregate(values: torch.Tensor, valid: torch.Tensor, mode: str) -> torch.Tensor:
    """Mean of ``values`` over ``valid`` per ``mode``; 0 (still attached to the graph) when nothing is valid."""
    values = torch.where(valid, values, torch.zeros_like(values))
    if mode == "token":
        return values.sum() / valid.sum().clamp(min=1)
    counts = valid.sum(-1)
    seq_means = values.sum(-1) / counts.clamp(min=1)
    return seq_means.sum() / (counts > 0).sum().clamp(min=1)


def _correction_weights(
    log_rho: torch.Tensor, base: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached per-token weights and the mask of tokens the correction keeps.

    Args:
        log_rho: ``[B, L]`` ``old - rollout`` logprobs, 0 outside ``base``.
        base: ``[B, L]`` tokens eligible for the loss.
        config: picks the correction.

    Returns:
        ``(weights, keep)``, both ``[B, L]``.
    """
    log_cap = math.log(config.is_cap)
    keep = torch.ones_like(base)
    if config.correction == "none":
        weights = torch.ones_like(log_rho)
    elif config.correction == "tis":
        # min(exp(x), C) == exp(min(x, log C)), which cannot overflow.
        weights = log_rho.clamp(max=log_cap).exp()
    elif config.correction == "decoupled":
        keep = log_rho <= log_cap
        weights = torch.where(keep, log_rho, torch.zeros_like(log_rho)).exp()
    elif config.correction == "tis_seq":
        seq = log_rho.sum(-1, keepdim=True).clamp(max=log_cap).exp()
        weights = seq.expand_as(log_rho)
    else:  # mis
        rho = log_rho.exp()
        keep = (rho >= config.mis_low) & (rho <= config.mis_high)
        weights = torch.ones_like(log_rho)
    return weights, keep


def _version_keep(
    base: torch.Tensor, config: LossConfig, token_versions: torch.Tensor | None, trainer_version: int | None
) -> torch.Tensor:
    """Mask of tokens within ``config.max_version_gap`` policy versions of ``trainer_version``."""
    if config.max_version_gap is None:
        return torch.ones_like(base)
    if token_versions is None or trainer_version is None:
        raise ValueError(
            f"loss.max_version_gap={config.max_version_gap} needs token_versions and trainer_version; "
            f"got {token_versions is None=} {trainer_version=}"
        )
    if token_versions.shape != base.shape:
        raise ValueError(f"{token_versions.shape=} must match logprobs {tuple(base.shape)}")
    return (trainer_version - token_versions.to(base.device)) <= config.max_version_gap


def _check_shapes(logprobs: torch.Tensor, advantages: torch.Tensor, **others: torch.Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, L], got {tuple(logprobs.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [B] or [B, L], got {tuple(advantages.shape)} for {tuple(logprobs.shape)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig,
    token_versions: torch.Tensor | None = None,
    trainer_version: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss with an off-policy correction, version-gap masking and an optional KL penalty.

    Per valid token: ``w * -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3`` with
    ``r = exp(logprobs - old_logprobs)``, ``w`` from ``config.correction`` (detached) and
    ``k3 = exp(ref - logprobs) - (ref - logprobs) - 1``; then aggregated per ``config.aggregation``.
    A token is valid if it is in ``loss_mask``, all its logprobs are finite, the correction keeps it and
    its version gap is within ``config.max_version_gap``. Only ``logprobs`` is differentiated.

    Args:
        logprobs: ``[B, L]`` current policy, with grad.
        old_logprobs: ``[B, L]`` trainer's policy before this update (proximal policy).
        rollout_logprobs: ``[B, L]`` behaviour policy, as reported by the engine.
        advantages: ``[B]`` (broadcast over tokens) or ``[B, L]``.
        loss_mask: ``[B, L]`` bool, True at generated response tokens.
        config: the loss settings.
        token_versions: ``[B, L]`` policy version that generated each token (needed for ``max_version_gap``).
        trainer_version: the trainer's current policy version (needed for ``max_version_gap``).
        ref_logprobs: ``[B, L]`` reference policy (needed when ``config.kl_coef > 0``).

    Returns:
        ``(loss, metrics)``: a scalar loss (0 with a graph to ``logprobs`` when no token is valid) and python
        floats ``loss``, ``pg_loss``, ``kl`` (with ``ref_logprobs``), ``clip_fraction``, ``ratio_mean``,
        ``is_weight_mean``, ``correction_masked_fraction``, ``version_masked_fraction``,
        ``nonfinite_fraction`` and ``valid_tokens``. Means are over valid tokens; masked fractions over
        finite tokens of ``loss_mask``.

    Raises:
        ValueError: on mismatched shapes, or a missing input that ``config`` needs.
    """
    others = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask}
    _check_shapes(logprobs, advantages, **others, ref_logprobs=ref_logprobs)
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"loss.kl_coef={config.kl_coef} > 0 needs ref_logprobs")
    mask = loss_mask.to(device=logprobs.device, dtype=torch.bool)
    inputs = [logprobs.float(), old_logprobs.detach().float(), rollout_logprobs.detach().float()]
    if ref_logprobs is not None:
        inputs.append(ref_logprobs.detach().float())
    finite = torch.stack([t.isfinite() for t in inputs]).all(0)
    base = mask & finite
    zero = torch.zeros((), device=logprobs.device)
    # Zero everything outside `base` first so no -inf or NaN reaches exp() or the backward pass.
    lp, old, rollout, *ref = (torch.where(base, t, zero) for t in inputs)

    weights, correction_keep = _correction_weights(old - rollout, base, config)
    version_keep = _version_keep(base, config, token_versions, trainer_version)
    valid = base & correction_keep & version_keep

    adv = advantages.detach().float().to(lp.device)
    adv = adv[:, None].expand_as(lp) if adv.dim() == 1 else adv
    ratio = (lp - old).exp()
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    unclipped_loss, clipped_loss = -ratio * adv, -clipped_ratio * adv
    pg_tokens = torch.maximum(unclipped_loss, clipped_loss) * weights
    pg_loss = _aggregate(pg_tokens, valid, config.aggregation)
    loss = pg_loss
    stats = {"pg_loss": pg_loss.detach()}
    if ref:
        delta = ref[0] - lp
        kl = _aggregate(delta.exp() - delta - 1, valid, config.aggregation)
        loss = loss + config.kl_coef * kl
        stats["kl"] = kl.detach()
    stats["loss"] = loss.detach()

    n_valid, n_base, n_mask = valid.sum().clamp(min=1), base.sum().clamp(min=1), mask.sum().clamp(min=1)
    stats["clip_fraction"] = (valid & (clipped_loss > unclipped_loss)).sum() / n_valid
    stats["ratio_mean"] = torch.where(valid, ratio.detach(), zero).sum() / n_valid
    stats["is_weight_mean"] = torch.where(valid, weights, zero).sum() / n_valid
    stats["correction_masked_fraction"] = (base & ~correction_keep).sum() / n_base
    stats["version_masked_fraction"] = (base & ~version_keep).sum() / n_base
    stats["nonfinite_fraction"] = (mask & ~finite).sum() / n_mask
    stats["valid_tokens"] = valid.sum()
    # One device->host copy for all metrics instead of one sync per .item().
    values = torch.stack([v.float() for v in stats.values()]).tolist()
    return loss, dict(zip(stats, values))


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's on the sampled tokens.

    With ``log_ratio = trainer - rollout`` over the masked tokens where both are finite: ``abs_diff_mean``
    and ``abs_diff_max`` of ``|log_ratio|``; the estimators of KL(rollout || trainer) from rollout samples
    ``k1 = mean(-log_ratio)``, ``k2 = mean(log_ratio**2 / 2)``, ``k3 = mean(exp(log_ratio) - 1 - log_ratio)``;
    ``ratio_outside_{c}``: the fraction of ``exp(log_ratio)`` outside ``[1/c, c]`` for each
    ``c`` in ``MISMATCH_RATIO_BOUNDS`` (keys ``ratio_outside_1.5``, ``ratio_outside_2``, ...). Also
    ``trainer_nonfinite_fraction`` and ``rollout_nonfinite_fraction`` among the masked tokens, and
    ``num_tokens`` (finite masked tokens the other stats cover).

    Args:
        trainer_logprobs: ``[B, L]`` trainer logprobs of the sampled tokens.
        rollout_logprobs: ``[B, L]`` engine logprobs of the same tokens.
        loss_mask: ``[B, L]`` bool, True at generated response tokens.

    Returns:
        python floats; all 0 when no token qualifies.

    Raises:
        ValueError: on mismatched shapes.
    """
    if not trainer_logprobs.shape == rollout_logprobs.shape == loss_mask.shape:
        raise ValueError(
            f"shapes differ: trainer_logprobs {tuple(trainer_logprobs.shape)}, "
            f"rollout_logprobs {tuple(rollout_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(device=trainer_logprobs.device, dtype=torch.bool)
    trainer = trainer_logprobs.detach().float()
    rollout = rollout_logprobs.detach().float().to(trainer.device)
    trainer_finite, rollout_finite = trainer.isfinite(), rollout.isfinite()
    valid = mask & trainer_finite & rollout_finite
    zero = torch.zeros((), device=trainer.device)
    log_ratio = torch.where(valid, trainer - rollout, zero)
    n_valid, n_mask = valid.sum().clamp(min=1), mask.sum().clamp(min=1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, zero).sum() / n_valid

    stats = {
        "abs_diff_mean": mean(log_ratio.abs()),
        "abs_diff_max": log_ratio.abs().max() if log_ratio.numel() else zero,
        "k1": mean(-log_ratio),
        "k2": mean(log_ratio.square() / 2),
        "k3": mean(torch.expm1(log_ratio) - log_ratio),
    }
    for c in MISMATCH_RATIO_BOUNDS:
        outside = (log_ratio.abs() > math.log(c)) & valid
        stats[f"ratio_outside_{c:g}"] = outside.sum() / n_valid
    stats["trainer_nonfinite_fraction"] = (mask & ~trainer_finite).sum() / n_mask
    stats["rollout_nonfinite_fraction"] = (mask & ~rollout_finite).sum() / n_mask
    stats["num_tokens"] = valid.sum()
    values = torch.stack([v.float() for v in stats.values()]).tolist()
    return dict(zip(stats, values))
