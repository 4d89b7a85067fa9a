"""The per-step record: what one trainer step consumed and did, as one compact JSON line per rank.

A training loop calls :meth:`StepRecorder.record` once per step, after its update (accepted or not),
with the collated batch, its trainer-side logprobs and advantages, and the update's numbers. The
record keeps *distributions*, not just means: every per-token or per-rollout quantity becomes a
:func:`summarize` summary (count, non-finite count, moments, quantiles, histogram), so one line stays
a few kB however large the batch, and the uids consumed are listed so the batch can be found again.
Lines go to ``{run_dir}/debug/steps-rank{r}.jsonl`` (orjson); nothing else blocks on the write.

Token quantities are taken where ``loss_mask`` is set (tokens the policy generated):

- ``logprob_diff``: trainer logprob - rollout logprob (``log r`` of the importance ratio).
- ``logprob_diff_onpolicy``: the same on tokens whose ``token_versions`` equals the trainer's
  version: these were sampled from the weights the trainer holds, so anything above numerical noise is
  a system bug (mask, positions, weights, version stamp), not off-policyness.
- ``importance_ratio``: ``exp(logprob_diff)``.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

__all__ = ["FIXED_EDGES", "MAX_LAG_BIN", "QUANTILES", "StepRecorder", "read_records", "step_record", "summarize"]

QUANTILES = (1, 5, 25, 50, 75, 95, 99)
PER_STEP_BINS = 16
MAX_LAG_BIN = 16
_DIFF_EDGES = [-1.0, -1e-1, -1e-2, -1e-3, -1e-4, -1e-5, -1e-6, 0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
FIXED_EDGES: dict[str, list[float]] = {
    "logprob_diff": _DIFF_EDGES,
    "logprob_diff_onpolicy": _DIFF_EDGES,
    "importance_ratio": [0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.001, 1.01, 1.05, 1.1, 1.25, 2.0],
}
"""Bin edges shared by every step (heat maps over time); ``counts`` has one more bin than ``edges``:
``(-inf, edges[0])``, ..., ``[edges[-1], +inf)``."""


def summarize(values: torch.Tensor, edges: list[float] | None = None) -> dict[str, Any]:
    """A bounded summary of a 1-d sample: ``n`` (finite values), ``nonfinite``, mean/std/min/max,
    quantiles ``q`` and a histogram (``edges`` given, or 16 equal bins over this sample's range).

    Everything is exact: one sort of the finite values gives the quantiles (linear interpolation, as
    ``numpy.percentile``) and the histogram (bin edges located in the sorted values).
    """
    x = values.detach().reshape(-1).float().cpu().numpy()
    finite = np.isfinite(x)
    nonfinite = int(x.size - np.count_nonzero(finite))
    xs = np.sort(x[finite] if nonfinite else x)
    n = int(xs.size)
    if n == 0:
        return {"n": 0, "nonfinite": nonfinite, "mean": None, "std": None, "min": None, "max": None,
                "q": {str(q): None for q in QUANTILES}, "hist": {"edges": edges or [], "counts": [0] * (len(edges or []) + 1)}}
    pos = np.asarray(QUANTILES, dtype=np.float64) / 100 * (n - 1)
    below = np.floor(pos).astype(np.int64)
    above = np.minimum(below + 1, n - 1)
    qs = (xs[below] + (pos - below) * (xs[above].astype(np.float64) - xs[below])).tolist()
    lo, hi = float(xs[0]), float(xs[-1])
    if edges is None:
        edges = np.linspace(lo, hi, PER_STEP_BINS + 1)[1:-1].tolist() if hi > lo else [lo]
    cuts = np.searchsorted(xs, np.asarray(edges, dtype=np.float32), side="left")
    counts = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
    return {
        "n": n,
        "nonfinite": nonfinite,
        "mean": float(xs.mean(dtype=np.float64)),
        "std": float(xs.std(dtype=np.float64, ddof=1)) if n > 1 else 0.0,
        "min": lo,
        "max": hi,
        "q": {str(q): v for q, v in zip(QUANTILES, qs)},
        "hist": {"edges": [float(e) for e in edges], "counts": counts},
    }


def step_record(
    *,
    step: int,
    rank: int,
    policy_version: int,
    batch: dict[str, Any],
    trainer_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    accepted: bool,
    guard_reason: str,
    loss: float,
    grad_norm: float,
    update_ratio: float,
    weight_bytes: int = 0,
    publish_s: float = 0.0,
    rewards: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The record of one step (see the module docstring); pure, no I/O.

    Args:
        policy_version: the trainer's version when it consumed the batch (before this step's update).
        batch: a collated batch (``datapipes.collate.collate_groups``).
        trainer_logprobs: ``[B, L]`` trainer-side logprobs aligned with ``batch["input_ids"]``.
        advantages: ``[B]`` per-rollout advantages.
        rewards: the rewards actually trained on, if they differ from ``batch["rewards"]``.
    """
    mask = batch["loss_mask"].bool().cpu()
    rollout_lp = batch["rollout_logprobs"].float().cpu()[mask]
    trainer_lp = trainer_logprobs.detach().float().cpu()[mask]
    diff = trainer_lp - rollout_lp
    onpolicy = (batch["token_versions"].cpu()[mask] == policy_version)
    rollout_versions = batch["policy_versions"].long().cpu()
    lag = (policy_version - rollout_versions).clamp_min(0)
    workers: dict[str, dict[str, Any]] = {}
    gen_s = batch.get("generate_s")
    lengths = batch["response_lengths"].tolist()
    for i, w in enumerate(batch["worker_ids"]):
        entry = workers.setdefault(w, {"rollouts": 0, "tokens": 0, "generate_s_sum": 0.0})
        entry["rollouts"] += 1
        entry["tokens"] += int(lengths[i])
        entry["generate_s_sum"] += float(gen_s[i]) if gen_s is not None else 0.0
    for entry in workers.values():
        entry["generate_s_mean"] = entry.pop("generate_s_sum") / entry["rollouts"]
    dist = {
        "reward": summarize(rewards if rewards is not None else batch["rewards"]),
        "advantage": summarize(advantages),
        "response_length": summarize(batch["response_lengths"].float()),
        "rollout_logprob": summarize(rollout_lp),
        "trainer_logprob": summarize(trainer_lp),
        "logprob_diff": summarize(diff, FIXED_EDGES["logprob_diff"]),
        "logprob_diff_onpolicy": summarize(diff[onpolicy], FIXED_EDGES["logprob_diff_onpolicy"]),
        "importance_ratio": summarize(diff.exp(), FIXED_EDGES["importance_ratio"]),
    }
    if gen_s is not None:
        dist["generate_s"] = summarize(gen_s.float())
    for name, values in batch.get("reward_components", {}).items():  # per reward function (asyncrl.rewards.reward_set)
        dist[f"reward/{name}"] = summarize(values[~values.isnan()])  # NaN: the function did not score that row
    return {
        "step": step,
        "rank": rank,
        "time": time.time(),
        "policy_version": policy_version,
        "accepted": accepted,
        "guard_reason": guard_reason,
        "loss": _num(loss),
        "grad_norm": _num(grad_norm),
        "update_ratio": _num(update_ratio),
        "dist": dist,
        "version_lag": {
            "hist": torch.bincount(lag.clamp_max(MAX_LAG_BIN), minlength=MAX_LAG_BIN + 1).tolist(),
            "mean": float(lag.float().mean()),
            "max": int(lag.max()),
        },
        "rollout_versions": {"min": int(rollout_versions.min()), "max": int(rollout_versions.max())},
        "workers": workers,
        "weight_sync": {"bytes": int(weight_bytes), "publish_s": float(publish_s)},
        "finish_reasons": dict(Counter(batch.get("finish_reasons", []))),
        "uids": list(batch["uids"]),
        "anomalies": [],
    }


def _num(v: float) -> float | None:
    """JSON has no NaN: non-finite numbers are written as null (the ``nonfinite`` counts keep the fact)."""
    v = float(v)
    return v if math.isfinite(v) else None


class StepRecorder:
    """Appends step records to ``{run_dir}/debug/steps-rank{rank}.jsonl``.

    Args:
        run_dir: the run's directory.
        rank: this trainer rank.
        append: continue an existing file (a resumed run); else start it over.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, append: bool = False):
        self.path = Path(run_dir) / "debug" / f"steps-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab" if append else "wb")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one ``steps-rank{r}.jsonl`` file, in order."""
    return [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]
