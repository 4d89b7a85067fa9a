"""What a trainer step logs: batch and loss statistics over all ranks, and the pipeline's cumulative counters.

:func:`batch_stats` all-reduces one step's reward mean, staleness (mean, max, histogram) and token count over the
process group (no collective at world size 1); :func:`global_metrics` turns each rank's ``loss/*`` and ``mismatch/*``
metrics (:func:`asyncrl.train.losses.compute_loss`, :func:`asyncrl.train.corrections.mismatch_metrics`) into the values
of the whole step, each mean weighted by the count it is a mean over (:data:`STEP_METRIC_WEIGHTS`), so that a step logs
the same numbers at 1 and N ranks. Both are collectives above world size 1: every rank calls each once per step, and
blocks in it until all have (a rank whose metrics have other names fails there, naming them, instead of mixing them up).
:func:`pipeline_counters` reads this rank's loader (pool, ledger, transport, what its workers report) and the weight
broadcaster's counters, without blocking on anything but the loader's lock. All return the keys ``metrics.jsonl``
carries (``recipes/grpo.py``; the freshness benchmark and ``asyncrl report`` read them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from asyncrl.debug.record import MAX_LAG_BIN
from asyncrl.train.corrections import MISMATCH_RATIO_BOUNDS

__all__ = ["STEP_METRIC_WEIGHTS", "WEIGHT_SYNC_KEYS", "WORKER_KEYS", "batch_stats", "global_metrics",
           "pipeline_counters"]

WEIGHT_SYNC_KEYS = ("versions_published", "bytes_served", "full_bytes", "delta_bytes", "buckets_full", "buckets_delta")
"""The broadcaster's counters each metrics record carries (bytes on the wire, full buckets and deltas)."""
WORKER_KEYS = ("busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated", "policy_version",
               "weight_full_bytes", "weight_delta_bytes", "busy_seq_s", "capacity_seq_s", "inflight_updates",
               "inflight_pause_p50_s", "inflight_pause_p99_s", "groups_resubmitted", "leases_held_s",
               "weights_via_shadow", "shadow_busy", "shadow_mismatch", "poll_s", "idle_queued_seq_s", "idle_empty_seq_s",
               "idle_no_lease_seq_s", "idle_slots_full_seq_s", "pause_seq_s", "credits_withheld_window_s",
               "credits_withheld_capacity_s", "credits_withheld_bytes_s", "credits_withheld_no_prompt_s")
"""What each worker's status contributes to a metrics record (the streaming loop's occupancy split, then the
pool's own seconds of credits withheld from the worker, by cause: ``asyncrl.pool.admission.WITHHELD``)."""


def batch_stats(rewards: torch.Tensor, staleness: torch.Tensor, num_tokens: int, device: torch.device) -> dict[str, Any]:
    """``reward_mean`` (NaN rewards count as 0), ``staleness_mean``/``_max``/``_hist`` (``hist[i]``: rollouts ``i``
    versions behind the trainer, the last bin ``i`` or more) and ``tokens`` over every rank of the group."""
    stats = torch.tensor([float(rewards.nan_to_num().sum()), float(rewards.numel()), float(staleness.sum()),
                          float(staleness.max()), float(num_tokens)], device=device)
    summed, top = stats.clone(), stats[3:4].clone()
    hist = torch.bincount(staleness.long().clamp(0, MAX_LAG_BIN), minlength=MAX_LAG_BIN + 1).to(device)
    # at world size 1 the three collectives are each rank's own values (gloo still costs ~1-2 ms per step on CPU)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        dist.all_reduce(hist)
    return {"reward_mean": float(summed[0] / summed[1]), "staleness_mean": float(summed[2] / summed[1]),
            "staleness_max": float(top[0]), "staleness_hist": hist.tolist(), "tokens": float(summed[4])}


RANK, SUM, MAX = "rank", "sum", "max"
"""How :func:`global_metrics` combines a metric over ranks besides a weighted mean: the mean over ranks (what DDP's
and FSDP2's gradient averaging optimises: used for losses, and for any metric the table does not name), the sum
(counts), the maximum."""

_VALID = ("kl", "clip_fraction", "cispo_clip_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
          "clip_ratio/region_mean", "ratio_mean", "is_weight_mean")
_FINITE = ("correction_masked_fraction", "version_masked_fraction", "truncated_masked_fraction")
_MISMATCH = ("abs_diff_mean", "k1", "k2", "k3") + tuple(f"ratio_outside_{c:g}" for c in MISMATCH_RATIO_BOUNDS)

STEP_METRIC_WEIGHTS: dict[str, str] = {
    "loss/loss": RANK, "loss/pg_loss": RANK,
    **{f"loss/{k}": "loss/valid_tokens" for k in _VALID},
    **{f"loss/{k}": "loss/finite_tokens" for k in _FINITE},
    "loss/nonfinite_fraction": "loss/response_tokens",
    "loss/vespo/phi_seq_mean": "loss/sequences",
    **{f"loss/{k}": SUM for k in ("valid_tokens", "finite_tokens", "response_tokens", "sequences")},
    **{f"mismatch/{k}": "mismatch/num_tokens" for k in _MISMATCH},
    "mismatch/abs_diff_max": MAX,
    "mismatch/trainer_nonfinite_fraction": "mismatch/response_tokens",
    "mismatch/rollout_nonfinite_fraction": "mismatch/response_tokens",
    "mismatch/num_tokens": SUM, "mismatch/response_tokens": SUM,
}
"""What each logged ``loss/*`` and ``mismatch/*`` metric is over: the name of the count it is a mean over (the
global value is ``sum_ranks(mean * count) / sum_ranks(count)``, i.e. the mean over every rank's tokens or
sequences, as one process would compute it on the union of the ranks' batches), or :data:`RANK`, :data:`SUM`,
:data:`MAX`. ``loss/loss`` and ``loss/pg_loss`` are the mean over ranks: for ``dapo``, ``cispo``, ``vespo`` (the
normaliser counts every rank's tokens) and, with equal batches per rank, ``grpo``, ``dr_grpo``, ``luspo``, ``sapo``,
that is the union's loss; ``bnpo`` normalises by each rank's own tokens by definition (TRL), so its mean over ranks
is not. A user loss's metrics (``loss.fn``) are means over ranks; its ``loss/kl`` is over ``loss/valid_tokens``."""


def global_metrics(metrics: Mapping[str, float], device: torch.device,
                   weights: Mapping[str, str] = STEP_METRIC_WEIGHTS) -> dict[str, float]:
    """Each metric of this rank combined with every rank's as ``weights`` says (a collective of three small
    all-reduces; without a process group of more than one rank, ``metrics`` unchanged).

    Args:
        metrics: this rank's metrics by logged name (``loss/...``, ``mismatch/...``); the same names on every rank.
        device: where the process group's tensors live (the trainer's device).
        weights: per name, the count it is a mean over (a name in ``metrics``), or ``RANK`` / ``SUM`` / ``MAX``;
            a name not listed, or whose count is missing, is a mean over ranks.

    Returns:
        the global values, python floats, in the order of ``metrics``.

    Raises:
        ValueError: on every rank, when the ranks' metric names differ (the values would be mixed up).
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return dict(metrics)
    names = list(metrics)
    digest = xxhash.xxh64_intdigest("\0".join(names).encode()) >> 2  # < 2**62: fits an int64, and so does its negation
    check = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if int(check[0]) != -int(check[1]):
        raise ValueError(f"rank {dist.get_rank()}: the ranks log different metric names (this rank's: {names}); "
                         "every rank's loss function must return the same metrics each step")
    how = {k: weights.get(k, RANK) for k in names}
    how = {k: RANK if w not in (RANK, SUM, MAX) and w not in metrics else w for k, w in how.items()}
    scale = [1.0 if w in (RANK, SUM, MAX) else float(metrics[w]) for w in how.values()]
    summed = torch.tensor([[float(metrics[k]) * c, c] for k, c in zip(names, scale)], dtype=torch.float64,
                          device=device)
    top = summed[:, 0].clone()
    dist.all_reduce(summed)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    out = {}
    for i, (k, w) in enumerate(how.items()):
        if w == SUM:
            out[k] = float(summed[i, 0])
        elif w == MAX:
            out[k] = float(top[i])
        else:  # a weighted mean; a count that is 0 on every rank gives 0, as each rank's own mean does
            out[k] = float(summed[i, 0] / summed[i, 1]) if float(summed[i, 1]) else 0.0
    return out


def pipeline_counters(loader: Any, broadcaster: Any | None) -> dict[str, Any]:
    """Cumulative counters of this rank's pool and what its workers report (busy time, output, weight bytes)."""
    stats = loader.stats()
    workers = stats["transport"].get("workers", {})
    return {
        "stale_dropped": stats["pool"].get("stale_dropped", 0),
        "regenerated": stats["ledger"].get("regenerated", 0),
        "rollouts_received": stats["pool"].get("rollouts_received", 0),
        "bad_messages": stats["transport"].get("bad_messages", 0),
        # the fleet floor (rollout.min_workers): pauses begun and seconds paused, this rank's loader
        "fleet_pauses": (stats.get("fleet") or {}).get("pauses", 0),
        "fleet_paused_s": round((stats.get("fleet") or {}).get("paused_s", 0.0), 3),
        "workers": {w: {k: v[k] for k in WORKER_KEYS if k in v} for w, v in workers.items()},
        "weight_sync": {k: v for k, v in broadcaster.stats().items() if k in WEIGHT_SYNC_KEYS}
        if broadcaster is not None else {},
    }
