"""Off-policy corrections of the train/inference mismatch: which tokens a loss keeps and how each is weighted.

Rollouts are sampled by an engine at a (possibly stale) policy version on another numeric stack; the trainer's
proximal policy differs. ``loss.correction`` turns ``rho = exp(old_logprobs - rollout_logprobs)`` into a detached
per-token weight and a keep mask (:func:`correction_weights`), ``loss.max_version_gap`` masks tokens generated too
many versions ago (:func:`version_keep`), and :func:`mismatch_metrics` measures the mismatch itself (logged, never
trained on). Pure tensor functions; masks are applied with ``torch.where`` (values outside may be ``-inf``).
"""

from __future__ import annotations

import math

import torch

from asyncrl.config import LossConfig

__all__ = ["MISMATCH_RATIO_BOUNDS", "correction_weights", "mismatch_metrics", "version_keep"]

MISMATCH_RATIO_BOUNDS = (1.5, 2.0, 5.0, 10.0)
"""``mismatch_metrics`` reports the fraction of IS ratios outside ``[1/c, c]`` for each ``c`` here."""


def correction_weights(
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


def version_keep(
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


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's on the sampled tokens.

    With ``log_ratio = trainer - rollout`` over the masked tokens where both are finite: ``abs_diff_mean``
    and ``abs_diff_max`` of ``|log_ratio|``; the estimators of KL(rollout || trainer) from rollout samples
    ``k1 = mean(-log_ratio)``, ``k2 = mean(log_ratio**2 / 2)``, ``k3 = mean(exp(log_ratio) - 1 - log_ratio)``;
    ``ratio_outside_{c}``: the fraction of ``exp(log_ratio)`` outside ``[1/c, c]`` for each
    ``c`` in ``MISMATCH_RATIO_BOUNDS`` (keys ``ratio_outside_1.5``, ``ratio_outside_2``, ...). Also
    ``trainer_nonfinite_fraction`` and ``rollout_nonfinite_fraction`` among the masked tokens, ``num_tokens``
    (finite masked tokens the other stats cover) and ``response_tokens`` (masked tokens).

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
    stats["num_tokens"], stats["response_tokens"] = valid.sum(), mask.sum()
    values = torch.stack([v.float() for v in stats.values()]).tolist()
    return dict(zip(stats, values))
