"""GRPO advantages: each reward against its group's, scaled as ``loss.scale_rewards`` says, or per reward function
first (``loss.multi_objective_aggregation: normalize_then_sum``). TRL 1.16's definitions.

Pure tensor functions over a collated batch's ``[B]`` rewards and group ids (``datapipes.collate.collate_groups``);
with ``all_reduce`` the batch-wide statistics are over every data-parallel rank (every rank must call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncrl.config.train import SCALE_REWARDS
from asyncrl.rewards.reward_set import UNSCORED

__all__ = ["compute_advantages", "group_advantages", "normalize_then_sum_advantages", "scored_rows"]


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


def scored_rows(batch: dict[str, Any]) -> torch.Tensor | None:
    """``[B]`` bool: False for rows no reward function scored (component ``unscored``); None if all were."""
    unscored = batch.get("reward_components", {}).get(UNSCORED)
    return None if unscored is None else ~(unscored.nan_to_num(0.0) > 0)
