"""What a trainer step logs: batch statistics over all ranks, and the pipeline's cumulative counters.

:func:`batch_stats` all-reduces one step's reward mean, staleness (mean, max, histogram) and token count
over the process group (a collective: every rank calls it once per step); :func:`pipeline_counters` reads
this rank's loader (pool, ledger, transport, what its workers report) and the weight broadcaster's
counters, without blocking on anything but the loader's lock. Both return the keys ``metrics.jsonl``
carries (``recipes/grpo.py``; the freshness benchmark and ``asyncrl report`` read them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncrl.debug.record import MAX_LAG_BIN

__all__ = ["WEIGHT_SYNC_KEYS", "WORKER_KEYS", "batch_stats", "pipeline_counters"]

WEIGHT_SYNC_KEYS = ("versions_published", "bytes_served", "full_bytes", "delta_bytes", "buckets_full", "buckets_delta")
"""The broadcaster's counters each metrics record carries (bytes on the wire, full buckets and deltas)."""
WORKER_KEYS = ("busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated", "policy_version",
               "weight_full_bytes", "weight_delta_bytes", "busy_seq_s", "capacity_seq_s", "inflight_updates",
               "inflight_pause_p50_s", "inflight_pause_p99_s", "groups_resubmitted")
"""What each worker's status contributes to a metrics record."""


def batch_stats(rewards: torch.Tensor, staleness: torch.Tensor, num_tokens: int, device: torch.device) -> dict[str, Any]:
    """``reward_mean`` (NaN rewards count as 0), ``staleness_mean``/``_max``/``_hist`` (``hist[i]``: rollouts ``i``
    versions behind the trainer, the last bin ``i`` or more) and ``tokens`` over every rank of the group."""
    stats = torch.tensor([float(rewards.nan_to_num().sum()), float(rewards.numel()), float(staleness.sum()),
                          float(staleness.max()), float(num_tokens)], device=device)
    summed, top = stats.clone(), stats[3:4].clone()
    hist = torch.bincount(staleness.long().clamp(0, MAX_LAG_BIN), minlength=MAX_LAG_BIN + 1).to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(summed)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        dist.all_reduce(hist)
    return {"reward_mean": float(summed[0] / summed[1]), "staleness_mean": float(summed[2] / summed[1]),
            "staleness_max": float(top[0]), "staleness_hist": hist.tolist(), "tokens": float(summed[4])}


def pipeline_counters(loader: Any, broadcaster: Any | None) -> dict[str, Any]:
    """Cumulative counters of this rank's pool and what its workers report (busy time, output, weight bytes)."""
    stats = loader.stats()
    workers = stats["transport"].get("workers", {})
    return {
        "stale_dropped": stats["pool"].get("stale_dropped", 0),
        "regenerated": stats["ledger"].get("regenerated", 0),
        "rollouts_received": stats["pool"].get("rollouts_received", 0),
        "bad_messages": stats["transport"].get("bad_messages", 0),
        "workers": {w: {k: v[k] for k in WORKER_KEYS if k in v} for w, v in workers.items()},
        "weight_sync": {k: v for k, v in broadcaster.stats().items() if k in WEIGHT_SYNC_KEYS}
        if broadcaster is not None else {},
    }
