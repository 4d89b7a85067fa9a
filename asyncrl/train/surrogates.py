"""The policy-loss surrogates, one registry keyed by ``loss.loss_type``: per-token loss terms and how they aggregate.

A :class:`LossType` is a surrogate (per-token terms from the step's :class:`Terms`, plus its own metrics) and an
aggregation (how the valid tokens' terms become one loss). TRL 1.16's ``loss_type`` values:

========  ==================================================  ============================================
type      surrogate                                           aggregation
========  ==================================================  ============================================
grpo      PPO-clip                                            mean over sequences of each one's token mean
bnpo      PPO-clip                                            this rank's token mean
dr_grpo   PPO-clip                                            sum / (sequences x max_completion_length)
dapo      PPO-clip                                            sum / (valid tokens of all ranks / ranks)
luspo     PPO-clip                                            mean over sequences of each one's token sum
cispo     ``-sg(min(r, epsilon_high)) * A * logp``            as dapo
sapo      ``-sigmoid(tau (r - 1)) * 4 / tau * A``             as grpo
vespo     ``-phi(w) * A * logp`` (a sequence Gamma weight)    as dapo
========  ==================================================  ============================================

Adding a loss type is one entry in :data:`LOSS_TYPES` (and its name in ``asyncrl.config.train.LOSS_TYPES``, which
a test keeps equal). Pure tensor functions; only ``logprobs`` carries the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.config import LossConfig

__all__ = ["AGGREGATIONS", "LOSS_TYPES", "LossType", "Terms", "aggregate", "vespo_weights"]

VESPO_LOG_W_MIN = math.log(1e-8)
"""``vespo``: the sequence log-weight is clamped to ``[log 1e-8, 20]`` (TRL's, after the VESPO authors' code)."""


@dataclass(frozen=True, slots=True)
class Terms:
    """What every surrogate sees of one step, all ``[B, L]`` (zero outside the valid tokens where it matters)."""

    lp: torch.Tensor
    """The policy's logprobs (with grad)."""
    old: torch.Tensor
    """The proximal policy's logprobs (detached)."""
    ratio: torch.Tensor
    """``exp(lp - old)`` (per token, or the sequence's with ``importance_sampling_level: sequence``)."""
    clipped_ratio: torch.Tensor
    """``ratio`` clipped to ``[1 - epsilon, 1 + epsilon_high]``."""
    capped_ratio: torch.Tensor
    """``ratio`` capped at ``delta`` (two-sided clipping), else ``ratio``."""
    adv: torch.Tensor
    """The advantages, broadcast over tokens (detached)."""
    weights: torch.Tensor
    """The correction's detached token weights (:mod:`asyncrl.train.corrections`)."""
    valid: torch.Tensor
    """The tokens in the loss."""
    n_valid: torch.Tensor
    """How many (at least 1): the denominator of token means."""
    per_row: bool
    """The advantages were given per row (``[B]``), not per token."""
    config: LossConfig


Surrogate = Callable[[Terms], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""Per-token loss terms and the surrogate's own metrics (tensors, token means over ``n_valid`` unless said)."""


def ppo_clip(t: Terms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w * max(-r_capped * A, -clip(r) * A)``: the PPO-clip surrogate with two-sided clipping."""
    return torch.maximum(-t.capped_ratio * t.adv, -t.clipped_ratio * t.adv) * t.weights, {}


def cispo(t: Terms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ScaleRL's ``-sg(min(r, epsilon_high)) * A * logp * w``; ``cispo_clip_ratio``: tokens the cap truncated."""
    cap = float(t.config.epsilon_high)
    tokens = -t.ratio.clamp(max=cap).detach() * t.adv * t.lp * t.weights
    return tokens, {"cispo_clip_ratio": (t.valid & (t.ratio > cap) & (t.adv > 0)).sum() / t.n_valid}


def sapo(t: Terms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The soft gate ``-sigmoid(tau (r - 1)) * 4 / tau * A * w``, ``tau`` by the advantage's sign."""
    tau = torch.where(t.adv > 0, t.config.sapo_temperature_pos, t.config.sapo_temperature_neg)
    return -torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau * t.adv * t.weights, {}


def vespo(t: Terms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO's ``-phi(w) * A * logp`` (:func:`vespo_weights`); ``vespo/phi_seq_mean``: phi's mean over sequences."""
    phi = vespo_weights(t.lp - t.old, t.weights, t.valid, t.adv, t.config)
    zero = torch.zeros((), device=phi.device)
    per_row = t.per_row and phi.shape[-1] > 0
    mean = (phi[:, 0].sum() / max(phi.shape[0], 1) if per_row else torch.where(t.valid, phi, zero).sum() / t.n_valid)
    return -phi * t.adv * t.lp, {"vespo/phi_seq_mean": mean}


def vespo_weights(
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


AllReduce = Callable[[torch.Tensor], torch.Tensor] | None
"""Sums a tensor over the data-parallel ranks in place and returns it; None: this rank only."""
Aggregation = Callable[[torch.Tensor, torch.Tensor, LossConfig, AllReduce], torch.Tensor]
"""``(terms zeroed outside valid, valid, config, all_reduce) -> loss``."""


def sequence_mean(values: torch.Tensor, valid: torch.Tensor, config: LossConfig, all_reduce: AllReduce) -> torch.Tensor:
    """Every row counts in the mean, a row without valid tokens as 0 (TRL's ``grpo``)."""
    return (values.sum(-1) / valid.sum(-1).clamp(min=1)).mean() if values.shape[0] else values.sum()


def sequence_sum(values: torch.Tensor, valid: torch.Tensor, config: LossConfig, all_reduce: AllReduce) -> torch.Tensor:
    """The mean over rows of each row's token sum (``luspo``)."""
    return values.sum(-1).mean() if values.shape[0] else values.sum()


def constant(values: torch.Tensor, valid: torch.Tensor, config: LossConfig, all_reduce: AllReduce) -> torch.Tensor:
    """The sum over Dr. GRPO's constant, sequences x ``max_completion_length``."""
    if config.max_completion_length is None:
        raise ValueError("loss.loss_type='dr_grpo' needs loss.max_completion_length (the recipe sets it to the "
                         "engine's max_new_tokens)")
    return values.sum() / (values.shape[0] * config.max_completion_length)


def token_mean(values: torch.Tensor, valid: torch.Tensor, config: LossConfig, all_reduce: AllReduce) -> torch.Tensor:
    """The sum over this rank's valid tokens (``bnpo``)."""
    return values.sum() / valid.sum().float().clamp(min=1)


def global_token_mean(values: torch.Tensor, valid: torch.Tensor, config: LossConfig,
                      all_reduce: AllReduce) -> torch.Tensor:
    """The sum over the valid tokens of all ranks / ranks: the same normaliser on every rank (``dapo``)."""
    count = valid.sum().float()
    if all_reduce is not None:
        totals = all_reduce(torch.stack([count, torch.ones_like(count)]))
        count = totals[0] / totals[1]
    return values.sum() / count.clamp(min=1)


AGGREGATIONS: dict[str, Aggregation] = {"sequence_mean": sequence_mean, "sequence_sum": sequence_sum,
                                        "constant": constant, "token_mean": token_mean,
                                        "global_token_mean": global_token_mean}


@dataclass(frozen=True, slots=True)
class LossType:
    """One ``loss.loss_type``: its surrogate and its aggregation (a key of :data:`AGGREGATIONS`)."""

    surrogate: Surrogate
    aggregation: str


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(ppo_clip, "sequence_mean"),
    "bnpo": LossType(ppo_clip, "token_mean"),
    "dr_grpo": LossType(ppo_clip, "constant"),
    "dapo": LossType(ppo_clip, "global_token_mean"),
    "luspo": LossType(ppo_clip, "sequence_sum"),
    "cispo": LossType(cispo, "global_token_mean"),
    "sapo": LossType(sapo, "sequence_mean"),
    "vespo": LossType(vespo, "global_token_mean"),
}
"""``loss.loss_type`` -> its surrogate and aggregation."""


def aggregate(values: torch.Tensor, valid: torch.Tensor, config: LossConfig, all_reduce: AllReduce = None
              ) -> torch.Tensor:
    """Per-token ``values`` over ``valid`` as ``config.loss_type`` aggregates them (TRL's ``_compute_loss``); 0,
    still attached to the graph, when nothing is valid."""
    values = torch.where(valid, values, torch.zeros_like(values))
    return AGGREGATIONS[LOSS_TYPES[config.loss_type].aggregation](values, valid, config, all_reduce)
