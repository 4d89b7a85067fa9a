"""The GRPO family as TRL 1.16 defines it: the loss of one training step, or the user's.

``compute_loss(batch, logprobs, config=...)`` is what a training step calls: advantages
(:mod:`asyncrl.train.advantages`: ``scale_rewards`` group / batch / none, or per reward function), then
:func:`policy_loss` or the user's ``loss.fn``. :func:`policy_loss` masks the tokens (the correction's and the version
gap's masks, :mod:`asyncrl.train.corrections`; ``mask_truncated_completions``), forms the ratio
(``importance_sampling_level`` token or sequence (GSPO), ``epsilon`` / ``epsilon_high`` clipping, two-sided clipping
``delta``), takes the ``loss_type``'s surrogate and aggregation from the registry (:mod:`asyncrl.train.surrogates`:
grpo / bnpo / dr_grpo / dapo / luspo, cispo / sapo / vespo) and adds the k3 KL to a reference model with ``beta``.
The names and their meanings are TRL's (``GRPOConfig`` and ``GRPOTrainer._compute_loss``);
:class:`~asyncrl.config.LossConfig` holds them.

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
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.config import LossConfig
from asyncrl.train.advantages import compute_advantages, normalize_then_sum_advantages, scored_rows
from asyncrl.train.corrections import correction_weights, version_keep
from asyncrl.train.surrogates import LOSS_TYPES, Terms, aggregate

__all__ = ["all_reduce_sum", "check_groups", "compute_loss", "load_loss_fn", "policy_loss", "truncated_rows"]

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

    weights, correction_keep = correction_weights(old - rollout, base, config)
    version_kept = version_keep(base, config, token_versions, trainer_version)
    truncated_keep = torch.ones_like(base)
    if config.mask_truncated_completions:
        if truncated is None or truncated.shape != base.shape[:1]:
            raise ValueError(f"loss.mask_truncated_completions needs truncated of shape {tuple(base.shape[:1])}, got "
                             f"{None if truncated is None else tuple(truncated.shape)}")
        truncated_keep = ~truncated.to(device=base.device, dtype=torch.bool)[:, None].expand_as(base)
    valid = base & correction_keep & version_kept & truncated_keep

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
    n_valid, n_base, n_mask = valid.sum().clamp(min=1), base.sum().clamp(min=1), mask.sum().clamp(min=1)
    terms = Terms(lp=lp, old=old, ratio=ratio, clipped_ratio=clipped_ratio, capped_ratio=capped, adv=adv,
                  weights=weights, valid=valid, n_valid=n_valid, per_row=advantages.dim() == 1, config=config)
    pg_tokens, surrogate_stats = LOSS_TYPES[config.loss_type].surrogate(terms)
    pg_loss = aggregate(pg_tokens, valid, config, all_reduce)
    stats = {"pg_loss": pg_loss.detach()}
    if ref:
        delta = ref[0] - lp
        k3 = delta.exp() - delta - 1
        loss = aggregate(pg_tokens + config.beta * k3, valid, config, all_reduce)  # TRL: per token, then aggregated
        stats["kl"] = torch.where(valid, k3.detach(), zero).sum() / n_valid
    else:
        loss = pg_loss
    stats["loss"] = loss.detach()

    low_clipped, high_clipped = valid & (ratio < low) & (adv < 0), valid & (ratio > high) & (adv > 0)
    stats["clip_fraction"] = (valid & (clipped_loss > unclipped_loss)).sum() / n_valid
    stats.update(surrogate_stats)  # cispo: cispo_clip_ratio; vespo: vespo/phi_seq_mean
    stats["clip_ratio/low_mean"] = low_clipped.sum() / n_valid
    stats["clip_ratio/high_mean"] = high_clipped.sum() / n_valid
    stats["clip_ratio/region_mean"] = (low_clipped | high_clipped).sum() / n_valid
    stats["ratio_mean"] = torch.where(valid, ratio.detach(), zero).sum() / n_valid
    stats["is_weight_mean"] = torch.where(valid, weights, zero).sum() / n_valid
    stats["correction_masked_fraction"] = (base & ~correction_keep).sum() / n_base
    stats["version_masked_fraction"] = (base & ~version_kept).sum() / n_base
    stats["truncated_masked_fraction"] = (base & ~truncated_keep).sum() / n_base
    stats["nonfinite_fraction"] = (mask & ~finite).sum() / n_mask
    stats["valid_tokens"] = valid.sum()
    stats["finite_tokens"], stats["response_tokens"] = base.sum(), mask.sum()  # the fractions' denominators
    stats["sequences"] = torch.tensor(base.shape[0], device=base.device)
    # One device->host copy for all metrics instead of one sync per .item().
    values = torch.stack([v.float() for v in stats.values()]).tolist()
    return loss, dict(zip(stats, values))


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


def truncated_rows(batch: dict[str, Any]) -> torch.Tensor:
    """``[B]`` bool: the rows whose completion hit the length limit (``finish_reason == "length"``)."""
    return torch.tensor([reason == "length" for reason in batch["finish_reasons"]], dtype=torch.bool)


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
        if config.fn is None:
            check_groups(batch["group_index"])
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


def check_groups(group_index: torch.Tensor) -> None:
    """Refuses a batch whose every group has one rollout: its group-relative advantages, and so the loss and the
    gradient, are 0 whatever the rewards (a run that trains nothing and says nothing).

    Raises:
        ValueError: naming the setting to change.
    """
    if group_index.numel() and int(torch.unique(group_index, return_counts=True)[1].max()) < 2:
        raise ValueError(
            "every group of this batch has one rollout (group_size=1): a rollout's advantage is its reward minus its "
            "group's mean, 0 in a group of one, so the loss and its gradient would be 0 at every step. Use "
            "group_size >= 2 (LoaderConfig.group_size; rollout.group_size in a run file), or a loss of your own "
            "(loss.fn) that does not use group advantages")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums ``t`` over the default process group in place and returns it; ``t`` itself without a process group.

    The ``all_reduce`` of :func:`compute_loss` for DDP / FSDP2 ranks (every rank must call the loss each step).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
