"""The GRPO family as TRL 1.16 defines it, with off-policy corrections, user losses and mismatch metrics.

``compute_loss(batch, logprobs, config=...)`` is what a training step calls: advantages
(:func:`compute_advantages`: ``scale_rewards`` group / batch / none), then :func:`policy_loss` (``loss_type``
grpo / bnpo / dr_grpo / dapo / luspo and the surrogates cispo / sapo / vespo, ``importance_sampling_level`` token or
sequence (GSPO), ``epsilon`` / ``epsilon_high`` clipping, two-sided clipping ``delta``, the k3 KL to a reference
model with ``beta``, ``mask_truncated_completions``) or the user's ``loss.fn``. The names and their meanings are TRL's
(``GRPOConfig`` and ``GRPOTrainer._compute_loss``); :class:`~asyncrl.config.LossConfig` holds them.

All functions take tensors laid out like ``datapipes.collate.collate_groups``: ``[B, L]`` per-token values
aligned to ``input_ids`` and a boolean ``loss_mask`` that is True at generated response tokens. Values
outside the mask may be anything, ``-inf`` included (``asyncrl.train.logprobs.token_logprobs`` puts ``-inf`` at
prompt tokens outside top-k/top-p), so masks are applied with ``torch.where`` and never by multiplying.

Three log-probabilities meet in :func:`policy_loss`:

* ``logprobs`` -- the policy being optimised (carries the graph);
* ``old_logprobs`` -- the trainer's policy before this update, the *proximal* policy of decoupled PPO
  (``logprobs.detach()`` when a batch gets a single optimizer step);
* ``rollout_logprobs`` -- the *behaviour* policy as the engine sampled it (a stale policy version and a
  different numeric stack: the train/inference mismatch that ``correction`` compensates);

and, with ``beta > 0``, ``ref_logprobs`` of the frozen reference policy (:mod:`asyncrl.train.reference`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.config import LossConfig
from asyncrl.config.train import SCALE_REWARDS
from asyncrl.rewards.reward_set import UNSCORED

__all__ = [
    "all_reduce_sum",
    "compute_advantages",
    "compute_loss",
    "group_advantages",
    "load_loss_fn",
    "mismatch_metrics",
    "normalize_then_sum_advantages",
    "policy_loss",
]

MISMATCH_RATIO_BOUNDS = (1.5, 2.0, 5.0, 10.0)
"""``mismatch_metrics`` reports the fraction of IS ratios outside ``[1/c, c]`` for each ``c`` here."""


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by the group's std.

    asyncrl's earlier form (population std, ``eps`` 1e-6); :func:`compute_advantages` is TRL's, which the
    recipe uses.

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


VESPO_LOG_W_MIN = math.log(1e-8)
"""``vespo``: the sequence log-weight is clamped to ``[log 1e-8, 20]`` (TRL's, after the VESPO authors' code)."""


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    scale_rewards: str = "group",
    scored: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO advantages exactly as TRL 1.16 computes them (``sum_then_normalize``).

    ``A = r - mean_group(r)``, divided by ``std + eps`` where ``std`` is the unbiased (Bessel) std of the
    group (``scale_rewards="group"``) or of the whole batch over all ranks (``"batch"``); not divided for
    ``"none"``. Rows that are not ``scored`` (no reward function scored them) are left out of the means and stds
    and get advantage 0, as does any row whose std is undefined (a group of one with scaling on).

    Args:
        rewards: ``[B]`` rewards.
        group_index: ``[B]`` group of each row (any ids).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        scored: ``[B]`` bool, False for rows no reward function scored; None: all scored.
        all_reduce: sums a tensor over the data-parallel ranks in place and returns it (``"batch"`` std over
            all ranks); None: this batch only.
        eps: added to the std.

    Returns:
        float32 ``[B]`` advantages.
    """
    if rewards.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(f"need 1-D rewards and group_index of one shape, got {rewards.shape=} {group_index.shape=}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"{scale_rewards=} must be one of {SCALE_REWARDS}")
    values = rewards.float()
    keep = torch.ones_like(values, dtype=torch.bool) if scored is None else scored.to(values.device, torch.bool)
    x = torch.where(keep, values, torch.zeros_like(values))
    _, inverse, _ = torch.unique(group_index, return_inverse=True, return_counts=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(groups, device=values.device).index_add_(0, inverse, keep.float())
    mean = torch.zeros(groups, device=values.device).index_add_(0, inverse, x) / count
    centered = torch.where(keep, values - mean[inverse], torch.zeros_like(values))
    if scale_rewards == "none":
        advantages = centered
    elif scale_rewards == "group":
        sq = torch.zeros(groups, device=values.device).index_add_(0, inverse, centered.square())
        # a group of one has no std (TRL: NaN, then advantage 0); its centered reward is 0, so std 0 gives 0 too
        std = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq)).sqrt()
        advantages = centered / (std[inverse] + eps)
    else:
        totals = torch.stack([keep.float().sum(), x.sum(), x.square().sum()])
        totals = all_reduce(totals) if all_reduce is not None else totals
        n, total, total_sq = totals.unbind()
        var = (total_sq - total.square() / n.clamp(min=1)) / (n - 1).clamp(min=1)
        advantages = centered / (var.clamp(min=0).sqrt() + eps)
    # a non-finite reward stays non-finite (the update guard rejects the step); unscored rows get 0
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def _aggregate(
    values: torch.Tensor,
    valid: torch.Tensor,
    config: LossConfig,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token ``values`` over ``valid`` as ``config.loss_type`` says (TRL's ``_compute_loss``); 0, still
    attached to the graph, when nothing is valid."""
    values = torch.where(valid, values, torch.zeros_like(values))
    total = values.sum()
    if config.loss_type in ("grpo", "sapo"):  # every row counts in the mean, a row without valid tokens as 0 (TRL)
        return (values.sum(-1) / valid.sum(-1).clamp(min=1)).mean() if values.shape[0] else total
    if config.loss_type == "luspo":
        return values.sum(-1).mean() if values.shape[0] else total
    if config.loss_type == "dr_grpo":
        if config.max_completion_length is None:
            raise ValueError("loss.loss_type='dr_grpo' needs loss.max_completion_length (the recipe sets it to the "
                             "engine's max_new_tokens)")
        return total / (values.shape[0] * config.max_completion_length)
    count = valid.sum().float()
    if config.loss_type in ("dapo", "cispo", "vespo") and all_reduce is not None:  # valid tokens of all ranks / ranks
        totals = all_reduce(torch.stack([count, torch.ones_like(count)]))
        count = totals[0] / totals[1]
    return total / count.clamp(min=1)


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


def _vespo_weights(
    log_ratio: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, adv: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """VESPO's detached ``[B, L]`` Gamma weights ``phi(w) = exp(lambda + k log w - lambda w)`` (TRL 1.16's
    ``GRPOTrainer.get_gamma_weights``).

    ``log w`` is the sum over the row's valid tokens of ``clamp(log-ratio, -20, 20)`` plus ``clamp(log weight,
    log 1e-8, 20)`` of the correction, itself clamped to ``[log 1e-8, 20]``; ``k, lambda`` follow the sign of the
    token's advantage (``>= 0``: ``_pos``; one per row for ``[B]`` advantages). A non-finite ``phi`` becomes 0.

    Args:
        log_ratio: ``[B, L]`` ``logprobs - old_logprobs``, 0 outside the valid tokens.
        weights: ``[B, L]`` the correction's detached token weights.
        valid: ``[B, L]`` tokens in the loss.
        adv: ``[B, L]`` the advantages.
        config: the ``vespo_*`` settings.
    """
    zero = torch.zeros((), device=log_ratio.device)
    with torch.no_grad():
        per_token = log_ratio.clamp(-20.0, 20.0) + weights.log().clamp(VESPO_LOG_W_MIN, 20.0)
        log_w = torch.where(valid, per_token, zero).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
        lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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
    truncated: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss with an off-policy correction, version-gap masking and an optional KL penalty.

    Per valid token: ``w * -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3`` with
    ``r = exp(logprobs - old_logprobs)``, ``w`` from ``config.correction`` (detached) and
    ``k3 = exp(ref - logprobs) - (ref - logprobs) - 1``; then aggregated per ``config.loss_type``.
    A token is valid if it is in ``loss_mask``, all its logprobs are finite, its row is not ``truncated``
    (with ``mask_truncated_completions``), the correction keeps it and its version gap is within
    ``config.max_version_gap``. Only ``logprobs`` is differentiated.

    Args:
        logprobs: ``[B, L]`` current policy, with grad.
        old_logprobs: ``[B, L]`` trainer's policy before this update (proximal policy).
        rollout_logprobs: ``[B, L]`` behaviour policy, as reported by the engine.
        advantages: ``[B]`` (broadcast over tokens) or ``[B, L]``.
        loss_mask: ``[B, L]`` bool, True at generated response tokens.
        config: the loss settings.
        token_versions: ``[B, L]`` policy version that generated each token (needed for ``max_version_gap``).
        trainer_version: the trainer's current policy version (needed for ``max_version_gap``).
        ref_logprobs: ``[B, L]`` reference policy (needed when ``config.beta > 0``).
        truncated: ``[B]`` bool, rows that hit the length limit (needed for ``mask_truncated_completions``).
        all_reduce: sums a tensor over the data-parallel ranks in place and returns it (``dapo``'s normaliser
            counts every rank's tokens); None: this rank only.

    Returns:
        ``(loss, metrics)``: a scalar loss (0 with a graph to ``logprobs`` when no token is valid) and python
        floats ``loss``, ``pg_loss``, ``kl`` (token mean, with ``ref_logprobs``), ``clip_fraction``,
        TRL's ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``ratio_mean``,
        ``is_weight_mean``, ``correction_masked_fraction``, ``version_masked_fraction``,
        ``truncated_masked_fraction``, ``nonfinite_fraction``, with ``cispo`` ``cispo_clip_ratio``, with ``vespo``
        ``vespo/phi_seq_mean`` (over rows), and the counts the means are over: ``valid_tokens``, ``finite_tokens``
        (of ``loss_mask``, all logprobs finite), ``response_tokens`` (of ``loss_mask``) and ``sequences``. Means are
        over valid tokens; masked fractions over finite tokens of ``loss_mask``, ``nonfinite_fraction`` over
        ``loss_mask``. :func:`asyncrl.train.step_metrics.global_metrics` combines them over ranks.

    Raises:
        ValueError: on mismatched shapes, or a missing input that ``config`` needs.
    """
    others = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask}
    _check_shapes(logprobs, advantages, **others, ref_logprobs=ref_logprobs)
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError(f"loss.beta={config.beta} > 0 needs ref_logprobs (the reference model's)")
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
    truncated_keep = torch.ones_like(base)
    if config.mask_truncated_completions:
        if truncated is None or truncated.shape != base.shape[:1]:
            raise ValueError(f"loss.mask_truncated_completions needs truncated of shape {tuple(base.shape[:1])}, got "
                             f"{None if truncated is None else tuple(truncated.shape)}")
        truncated_keep = ~truncated.to(device=base.device, dtype=torch.bool)[:, None].expand_as(base)
    valid = base & correction_keep & version_keep & truncated_keep

    adv = advantages.detach().float().to(lp.device)
    adv = adv[:, None].expand_as(lp) if adv.dim() == 1 else adv
    log_ratio = lp - old
    if config.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, its tokens' mean log-ratio
        seq = torch.where(valid, log_ratio, zero).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.expand_as(lp)
    ratio = log_ratio.exp()
    low, high = config.clip_range
    clipped_ratio = ratio.clamp(low, high)
    capped = ratio.clamp(max=config.delta) if config.delta is not None else ratio  # two-sided clipping
    unclipped_loss, clipped_loss = -capped * adv, -clipped_ratio * adv
    if config.loss_type == "cispo":
        pg_tokens = -ratio.clamp(max=float(config.epsilon_high)).detach() * adv * lp * weights  # epsilon_high: the cap
    elif config.loss_type == "sapo":
        tau = torch.where(adv > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
        pg_tokens = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv * weights
    elif config.loss_type == "vespo":
        phi = _vespo_weights(lp - old, weights, valid, adv, config)
        pg_tokens = -phi * adv * lp
    else:
        pg_tokens = torch.maximum(unclipped_loss, clipped_loss) * weights
    pg_loss = _aggregate(pg_tokens, valid, config, all_reduce)
    stats = {"pg_loss": pg_loss.detach()}
    n_valid, n_base, n_mask = valid.sum().clamp(min=1), base.sum().clamp(min=1), mask.sum().clamp(min=1)
    if ref:
        delta = ref[0] - lp
        k3 = delta.exp() - delta - 1
        loss = _aggregate(pg_tokens + config.beta * k3, valid, config, all_reduce)  # TRL: per token, then aggregated
        stats["kl"] = torch.where(valid, k3.detach(), zero).sum() / n_valid
    else:
        loss = pg_loss
    stats["loss"] = loss.detach()

    low_clipped, high_clipped = valid & (ratio < low) & (adv < 0), valid & (ratio > high) & (adv > 0)
    stats["clip_fraction"] = (valid & (clipped_loss > unclipped_loss)).sum() / n_valid
    if config.loss_type == "cispo":  # TRL's cispo_clip_ratio: tokens whose weight the cap truncated
        stats["cispo_clip_ratio"] = (valid & (ratio > float(config.epsilon_high)) & (adv > 0)).sum() / n_valid
    if config.loss_type == "vespo":  # TRL's vespo/phi_seq_mean: over sequences
        per_row = advantages.dim() == 1 and phi.shape[-1] > 0
        stats["vespo/phi_seq_mean"] = (phi[:, 0].sum() / max(phi.shape[0], 1) if per_row
                                       else torch.where(valid, phi, zero).sum() / n_valid)
    stats["clip_ratio/low_mean"] = low_clipped.sum() / n_valid
    stats["clip_ratio/high_mean"] = high_clipped.sum() / n_valid
    stats["clip_ratio/region_mean"] = (low_clipped | high_clipped).sum() / n_valid
    stats["ratio_mean"] = torch.where(valid, ratio.detach(), zero).sum() / n_valid
    stats["is_weight_mean"] = torch.where(valid, weights, zero).sum() / n_valid
    stats["correction_masked_fraction"] = (base & ~correction_keep).sum() / n_base
    stats["version_masked_fraction"] = (base & ~version_keep).sum() / n_base
    stats["truncated_masked_fraction"] = (base & ~truncated_keep).sum() / n_base
    stats["nonfinite_fraction"] = (mask & ~finite).sum() / n_mask
    stats["valid_tokens"] = valid.sum()
    stats["finite_tokens"], stats["response_tokens"] = base.sum(), mask.sum()  # the fractions' denominators
    stats["sequences"] = torch.tensor(base.shape[0], device=base.device)
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


@functools.cache
def load_loss_fn(spec: str) -> Callable[..., Any]:
    """Imports a user loss, ``"module:function"`` (``loss.fn``).

    Raises:
        TypeError: for a spec that names no callable (``module:function``).
    """
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name, None) if name else None
    if not callable(fn):
        raise TypeError(f"loss.fn={spec!r} must name a function as 'module:function'")
    return fn


def normalize_then_sum_advantages(
    components: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_index: torch.Tensor,
    *,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages as TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"`` computes them.

    Per reward function ``k``: ``(r_k - mean_group(r_k)) / (std_group(r_k) + eps)`` over the rows it scored (NaN
    elsewhere; std unbiased, undefined for one row: that function then adds nothing to the row); the weighted sum
    over functions (NaN-skipping); then ``(s - mean) / (std + eps)`` over the scored rows of the whole batch, all
    ranks. Rows no function scored get 0.

    Args:
        components: ``batch["reward_components"]``: per function name ``[B]`` rewards, NaN where it did not score.
        weights: the weight of each reward function by name (``reward.weights``); functions of the batch not named
            here are not rewards (an environment's info) and are left out.
        group_index: ``[B]`` group of each row.
        all_reduce: sums a tensor over the data-parallel ranks in place and returns it; None: this batch only.
        eps: added to each std.

    Returns:
        float32 ``[B]`` advantages.

    Raises:
        ValueError: when no function of ``weights`` is in ``components`` (the batch carries no per-function rewards).
    """
    names = [n for n in weights if n in components]
    if not names:
        raise ValueError(f"loss.multi_objective_aggregation='normalize_then_sum' needs each reward function's rewards "
                         f"in the batch; reward functions {sorted(weights)}, batch components {sorted(components)}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    total = torch.zeros(group_index.shape, dtype=torch.float32, device=group_index.device)
    scored = torch.zeros(group_index.shape, dtype=torch.bool, device=group_index.device)
    for name in names:
        r = components[name].float().to(total.device)
        keep = r.isfinite()
        x = torch.where(keep, r, torch.zeros_like(r))
        count = torch.zeros(groups, device=r.device).index_add_(0, inverse, keep.float())
        mean = torch.zeros(groups, device=r.device).index_add_(0, inverse, x) / count.clamp(min=1)
        centered = torch.where(keep, r - mean[inverse], torch.zeros_like(r))
        sq = torch.zeros(groups, device=r.device).index_add_(0, inverse, centered.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        defined = keep & (count[inverse] > 1)  # TRL: NaN std for one row, and nansum skips it
        total += torch.where(defined, float(weights[name]) * centered / (std[inverse] + eps), torch.zeros_like(r))
        scored |= keep
    x = torch.where(scored, total, torch.zeros_like(total))
    totals = torch.stack([scored.float().sum(), x.sum(), x.square().sum()])
    totals = all_reduce(totals) if all_reduce is not None else totals
    n, s, sq = totals.unbind()
    mean = s / n.clamp(min=1)
    std = ((sq - s.square() / n.clamp(min=1)) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
    std = torch.where(n > 1, std, torch.zeros_like(std))  # TRL: a batch of one row has std 0
    return torch.where(scored, (total - mean) / (std + eps), torch.zeros_like(total))


def truncated_rows(batch: dict[str, Any]) -> torch.Tensor:
    """``[B]`` bool: the rows whose completion hit the length limit (``finish_reason == "length"``)."""
    return torch.tensor([reason == "length" for reason in batch["finish_reasons"]], dtype=torch.bool)


def scored_rows(batch: dict[str, Any]) -> torch.Tensor | None:
    """``[B]`` bool: False for rows no reward function scored (component ``unscored``); None if all were."""
    unscored = batch.get("reward_components", {}).get(UNSCORED)
    return None if unscored is None else ~(unscored.nan_to_num(0.0) > 0)


def compute_loss(
    batch: dict[str, Any],
    logprobs: torch.Tensor,
    *,
    config: LossConfig,
    trainer_version: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    reward_weights: dict[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """One step's loss from a collated batch (``datapipes.collate``) and the trainer's logprobs of it.

    Advantages come from :func:`compute_advantages` (``config.scale_rewards``), then either
    :func:`policy_loss` (``config.loss_type``, clipping, corrections, KL) or the user's ``config.fn``, called as::

        fn(batch, logprobs, *, advantages, old_logprobs, ref_logprobs, config, trainer_version)
            -> loss | (loss, {name: float})

    with only the keywords its signature names (all of them with ``**kwargs``): ``batch`` with its tensors on
    ``logprobs``' device, ``logprobs`` ``[B, L]`` with grad (aligned to ``input_ids``; ``-inf`` possible outside
    ``batch["loss_mask"]``), ``old_logprobs`` its detached copy (one optimizer step per batch), ``ref_logprobs``
    the reference model's (None unless ``config.beta > 0``). Whatever it returns goes through the update guard
    like the built-in loss: a NaN loss is rejected and the parameters stay as they were.

    ``reward_weights`` (``{function name: weight}``) is needed by ``multi_objective_aggregation:
    normalize_then_sum``, whose advantages come from the per-function rewards in ``batch["reward_components"]``.

    Returns:
        ``(loss, metrics, advantages)``; metrics as :func:`policy_loss`'s, or the user's plus ``loss`` (and
        ``kl``, the token mean of k3, and ``valid_tokens`` unless the user's has it, when there are
        ``ref_logprobs``).

    Raises:
        TypeError: when the user's function returns something other than a scalar tensor (and a dict).
    """
    device = logprobs.device
    if config.multi_objective_aggregation == "normalize_then_sum":
        if reward_weights is None:
            raise ValueError("loss.multi_objective_aggregation='normalize_then_sum' needs reward_weights (the reward "
                             "functions' names and weights; the recipe passes reward.weights)")
        advantages = normalize_then_sum_advantages(batch.get("reward_components", {}), reward_weights,
                                                   batch["group_index"].to(device), all_reduce=all_reduce)
        if not batch["rewards"].isfinite().all():  # a non-finite reward stays visible to the update guard
            advantages = advantages + batch["rewards"].to(device) * 0
    else:
        advantages = compute_advantages(batch["rewards"].to(device), batch["group_index"].to(device),
                                        scale_rewards=str(config.scale_rewards), scored=scored_rows(batch),
                                        all_reduce=all_reduce)
    mask = batch["loss_mask"].to(device)
    if config.fn is None:
        loss, metrics = policy_loss(
            logprobs, logprobs.detach(), batch["rollout_logprobs"].to(device), advantages, mask, config=config,
            token_versions=batch["token_versions"].to(device), trainer_version=trainer_version,
            ref_logprobs=ref_logprobs, all_reduce=all_reduce,
            truncated=truncated_rows(batch) if config.mask_truncated_completions else None,
        )
        return loss, metrics, advantages
    fn = load_loss_fn(config.fn)
    offered = {"advantages": advantages, "old_logprobs": logprobs.detach(), "ref_logprobs": ref_logprobs,
               "config": config, "trainer_version": trainer_version}
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        offered = {k: v for k, v in offered.items() if k in params}
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out = fn(on_device, logprobs, **offered)
    loss, user_metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not isinstance(user_metrics, dict):
        raise TypeError(f"loss.fn={config.fn!r} must return a scalar tensor or (scalar tensor, dict of floats), got "
                        f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))} and {type(user_metrics).__name__}")
    metrics = {k: float(v) for k, v in user_metrics.items()}
    metrics["loss"] = float(loss.detach())
    if ref_logprobs is not None and "kl" not in metrics:
        valid = mask.bool() & logprobs.isfinite() & ref_logprobs.isfinite()
        delta = torch.where(valid, ref_logprobs - logprobs.detach(), torch.zeros((), device=device))
        metrics["kl"] = float((delta.exp() - delta - 1).sum() / valid.sum().clamp(min=1))
        metrics.setdefault("valid_tokens", float(valid.sum()))  # what kl is a mean over, for the ranks' mean
    return loss.reshape(()), metrics, advantages


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums ``t`` over the default process group in place and returns it; ``t`` itself without a process group.

    The ``all_reduce`` of :func:`compute_loss` for DDP / FSDP2 ranks (every rank must call the loss each step).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
