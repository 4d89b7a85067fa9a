"""Freshness vs throughput: what ``rollout.max_staleness`` buys, against the pipelining bound.

    python -m benchmarks.freshness measured [--staleness 0,1,2,4] [--workers 1,2] [--steps 40] [--warmup 5]
        [--repeats 1] [--ranks 1] [--engine hf|vllm] [--model DIR] [--length-median 24 --length-tail 1.0
        --max-new-tokens 128] [--config recipes/configs/tiny_cpu.yaml] [--set key=value ...]
    python -m benchmarks.freshness simulated [--calibrate RESULTS.json | --tokens-per-s X --train-s-per-token X
        --sync-s-per-byte X --weight-bytes N] [--workers 4,16,64] [--staleness 0,1,2,4]
        [--length-median M --length-tail S --max-new-tokens 32768] [--time-scale X] [--steps N]
    python -m benchmarks.freshness simulated ... --write-baseline   # refresh benchmarks/baselines/freshness.json
    python -m benchmarks.freshness simulated ... --check-baseline   # exit 1 if the ratios left the baseline's bands

Every point ``(max_staleness k, workers w)`` is one training run that writes the recipe's
``metrics.jsonl``; both modes share one analysis of that file.

**Measured** (everything real): ``recipes/grpo.py`` under torchrun (``--ranks`` gloo trainer ranks, ``w``
local rollout workers per rank with the HF or vLLM engine, shm weight broadcast after every accepted
step), on the embedded tiny Qwen2 by default. The workload is made long-tailed on purpose:
``engine.ignore_eos`` with lognormal response lengths (``--length-median/--length-tail/--max-new-tokens``;
``--natural-lengths`` keeps EOS), so stragglers exist as in real reasoning RL. Who blocks on what:
the trainer blocks in ``next(loader)`` (``wait_s``) until ``batch_size`` groups no staler than ``k`` are
buffered; workers block on lease credits (``capacity``) and apply new weights between engine batches;
with ``k = 0`` every step waits for a full generation round after the previous publish, and groups a
worker generated ahead (the pool's ``capacity`` exceeds one batch) under the old version are dropped and
regenerated (``regenerated_frac``), which on shared cores also takes CPU from the trainer. ``--workers``
counts workers per trainer rank (``rollout.num_workers``); each serves every rank.

**Simulated** (:mod:`benchmarks.freshness_sim`, written separately): fake engines whose generation
and weight-load times follow a time model, a trainer loop whose train and publish times are modelled;
the loader, pool, ledger, worker processes, sockets and broadcaster are the real ones. It can be
calibrated from a measured run (``--calibrate``) and scaled to worker counts and lengths this machine
cannot run. Its rows are in wall seconds with a ``time_scale``; the analysis multiplies durations by it,
so simulated rates are per modelled second (ratios do not change).

Per point, over the steps after ``--warmup`` (rows ``warmup+1..N``; the counters' base is row ``warmup``;
worker counters arrive with heartbeats, every ``HEARTBEAT_S`` = 0.5 s in measured runs, so the window
should span many seconds):

* ``rollouts_per_s`` / ``tokens_per_s``: trained rollouts (the summed ``staleness_hist``, all ranks) and
  batch tokens (prompt + response) per wall-clock second.
* ``trainer_idle``: sum ``wait_s`` / sum ``step_s``. ``worker_idle``: 1 - sum Δ``busy_s`` / sum Δ``uptime_s``
  over workers (waiting for leases *and* applying weights count as idle; ``weight_apply_share`` splits
  the latter out).
* staleness ``mean``/``p50``/``p99`` of the summed histogram; ``publish_s`` (mean over accepted steps);
  ``weight_apply_s`` per update per worker (Δ``weight_apply_s`` / Δ worker ``policy_version``);
  ``regenerated_frac``: Δ``stale_dropped`` groups / groups trained.
* ``leases_held`` (streaming workers): mean leases held per worker, Δ``leases_held_s`` / Δ``uptime_s``;
  ``withheld_window`` / ``withheld_capacity``: the share of the workers' uptime in which the pool granted none of
  their free credits because of the staleness window (groups leased and buffered the trainer has not taken: the
  trainer is behind) or its ``capacity`` (the workers' ``credits_withheld_*_s``, counted by the pool); where
  ``occ_no_lease`` is high and these are not, the credits were in their round trip;
  ``train_s_per_token``: sum ``train_s`` / batch tokens; ``load_avg_1m``: the machine's 1-minute load when the run
  ended (loops run point by point, interleaved, so both sides of a comparison see the same drift).
* ``occupancy`` = busy slot-time / available slot-time of the engines (``Engine.occupancy``: a sequence is busy from
  the moment it gets a running slot to its own last token, less in-flight pauses; available = ``max_num_seqs`` x the
  seconds the engine had work). Streaming HF workers also split the available slot-time by cause
  (``OCCUPANCY_SPLIT``, summing to 1: ``occ_busy`` = occupancy, ``occ_pause``, ``occ_admission``, ``occ_no_lease``,
  ``occ_slots_full``, ``occ_worker``), and ``outside_poll`` is the share of their busy time the worker's main
  thread spent outside ``engine.poll`` (rewards, sends, weights: the HF engine does not decode then, yet its
  running rows count busy). ``inflight_pause_p50_s``/``_p99_s``: ``engine.apply_weights`` with requests in flight
  (each worker's p50 over its run, the median over workers; the max of their p99s).
* the bound: generation capacity ``G`` = Δ``rollouts_sent`` / (Δ``busy_s`` / workers), the aggregate
  rollouts/s with every worker always busy; training capacity ``T`` = rollouts / sum(``train_s`` +
  ``publish_s``), the rollouts/s of a trainer that never waits. Ideal pipelined throughput is
  ``min(G, T)``; ``efficiency`` = measured / ``min(G, T)``; ``speedup`` = rollouts/s over the
  ``max_staleness = 0`` point with the same worker count, in the same run.

On a machine where the trainer and the workers share cores (the 2-vCPU CI box), G and T are not
independent resources: each is measured while the other competes for the CPU, so a point's own
``min(G, T)`` shrinks as overlap grows and its ``efficiency`` flatters it. ``efficiency_uncontended`` divides
by the ``min(G, T)`` of the ``k = 0`` point with the same workers instead, where generation and training
alternate and each has the machine to itself: the ideal overlap of two independent resources, which shared
cores cannot reach (the bound is optimistic there).

Outputs: ``benchmarks/results/freshness-{mode}-{date}.json`` (config, machine, commit, date, per point
median/min/max over ``--repeats``, the bound, ratios, reward-vs-wall-clock series, staleness
histograms and the calibration summary) and PNGs in ``benchmarks/results/freshness-{mode}-{date}/``.

The calibration summary (``results["calibration"]``, the dict ``SimConfig.from_measured`` takes; rates are
medians over the repeats of the ``max_staleness = 0`` points, where generation and training alternate and
each is measured with the machine to itself, or over every point if the sweep has no ``k = 0``)::

    version                          1
    calibrated_from                  the [max_staleness, workers] points the rates come from
    gen_tokens_per_s_per_worker      response tokens one worker generates per second while busy (aggregate over
                                     its batch: Δtokens_generated / Δbusy_s)
    gen_rollouts_per_s_per_worker    rollouts one worker generates per second while busy
    decode_tokens_per_s_per_sequence decode steps per second of a statically batched call: gen_rollouts_per_s_per_worker
                                     / rows_per_call * longest_row_per_call (what SimConfig.tokens_per_s_per_worker
                                     models: a call takes longest_row / it); an estimate, see below
    rows_per_call                    max_batch * group_size (a worker's full engine call)
    longest_row_per_call             expected longest response of such a call under the length distribution
                                     (Monte Carlo; max_new_tokens for natural lengths)
    train_s_per_token                trainer seconds (train_s) per batch token (prompt + response, all ranks)
    train_s_per_rollout              the same per trained rollout
    sync_s_per_byte                  sum publish_s / sum weight_bytes over accepted steps (alias publish_s_per_byte)
    weight_bytes                     bytes published per update
    weight_apply_s                   worker seconds to apply one update; apply_s_per_byte = it / weight_bytes
    response_tokens_mean             mean generated tokens per rollout (Δtokens_generated / Δrollouts_sent)
    prompt_tokens                    mean prompt tokens per trained rollout
    engine, ignore_eos, length_median, length_tail, min_new_tokens, max_new_tokens   the workload
    group_size, batch_size (groups per trainer step, all ranks), batch_size_per_rank, ranks, max_batch, slots,
    workers_per_rank                 the recipe's shape

The decode estimate assumes full engine calls (``max_batch`` leases each) decoding to their longest row,
which is how the HF engine batches; vLLM batches continuously, so for it the estimate is rougher.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from benchmarks._report import git_commit, machine

__all__ = ["analyze", "calibration_summary", "compare_to_baseline", "main", "read_metrics", "summarize"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
BASELINE = ROOT / "benchmarks" / "baselines" / "freshness.json"
DEFAULT_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
RECIPE = ROOT / "recipes" / "grpo.py"
SPEEDUP_REL_TOL = 0.35
"""Baseline band of a speedup: within this relative distance of the reference."""
EFFICIENCY_ABS_TOL = 0.2
"""Baseline band of an efficiency: at least the reference minus this."""
OCCUPANCY_SPLIT = ("occ_busy", "occ_pause", "occ_admission", "occ_no_lease", "occ_slots_full", "occ_worker")
"""Shares of the streaming engines' available slot-time (they sum to 1; HF scheduler only, else None): ``busy``
(= occupancy), ``pause`` (running rows held by in-flight re-prefills), and free rows while the engine had work:
``admission`` (sequences queued or prefilling: admission batching), ``no_lease`` (nothing queued and the worker held
fewer than ``slots`` leases: the pool granted no more: staleness window, ``capacity``, a trainer that let the
buffer fill), ``slots_full`` (nothing queued, all ``slots`` leases inside: too few slots for the width),
``worker`` (nothing queued while the worker's main thread was outside ``poll``: rewards, sends, weights)."""
SPLIT_COLUMNS = (*OCCUPANCY_SPLIT, "outside_poll", "withheld_window", "withheld_capacity")
"""The streaming points' split table: the slot-time shares, the worker's time outside ``poll``, and the shares of its
uptime the pool withheld its free credits at the staleness window or at ``capacity``."""
SCALARS = (
    "rollouts_per_s", "tokens_per_s", "trainer_idle", "worker_idle", "weight_apply_share", "staleness_mean",
    "staleness_p50", "staleness_p99", "staleness_max", "publish_s", "weight_apply_s", "regenerated_frac",
    "gen_capacity", "train_capacity", "bound", "efficiency", "reward_first", "reward_last", "wall_s",
    "occupancy", "inflight_pause_p50_s", "inflight_pause_p99_s", "resubmitted_frac", "leases_held",
    "train_s_per_token", "load_avg_1m", *OCCUPANCY_SPLIT, "outside_poll", "withheld_window", "withheld_capacity",
)

HEARTBEAT_S = 0.5
"""Measured runs: workers report their counters with each heartbeat, so they lag by up to this (the
simulator uses the same); the recipe's default is 1 s."""

RunPoint = Callable[[int, int, int, Path], Path]
"""``(max_staleness, workers, repeat, run_dir) -> metrics.jsonl`` of one training run."""


# ----------------------------------------------------------------------------------------------------------------------
# analysis: one metrics.jsonl -> per-point numbers (shared by both modes)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a recipe-schema ``metrics.jsonl``."""
    return [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


def _quantile(hist: list[float], q: float) -> int:
    total, acc = sum(hist), 0.0
    for i, count in enumerate(hist):
        acc += count
        if acc >= q * total:
            return i
    return len(hist) - 1


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _worker_deltas(base: dict[str, Any], last: dict[str, Any]) -> dict[str, float]:
    """Summed growth of each worker counter between two pipeline snapshots (a worker absent from the base
    started inside the window: all of its counters count)."""
    out = {k: 0.0 for k in ("busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated",
                            "busy_seq_s", "capacity_seq_s", "groups_resubmitted", "leases_held_s", "poll_s",
                            "idle_queued_seq_s", "idle_empty_seq_s", "idle_no_lease_seq_s", "idle_slots_full_seq_s",
                            "pause_seq_s", "credits_withheld_window_s", "credits_withheld_capacity_s")}
    out["split"] = all("idle_empty_seq_s" in v for v in last["workers"].values()) and bool(last["workers"])
    out["withheld"] = all("credits_withheld_window_s" in v for v in last["workers"].values()) and bool(last["workers"])
    updates = []
    for wid, now in last["workers"].items():
        before = base["workers"].get(wid, {})
        for k in out:
            out[k] += now.get(k, 0) - before.get(k, 0)
        updates.append(now.get("policy_version", 0) - before.get("policy_version", 0))
    out["workers"] = len(last["workers"])
    out["updates_per_worker"] = statistics.mean(updates) if updates else 0.0
    # the in-flight update pause (streaming workers): each worker reports its own p50/p99 over its whole run
    p50 = [v["inflight_pause_p50_s"] for v in last["workers"].values() if "inflight_pause_p50_s" in v]
    p99 = [v["inflight_pause_p99_s"] for v in last["workers"].values() if "inflight_pause_p99_s" in v]
    out["inflight_pause_p50_s"] = statistics.median(p50) if p50 else None
    out["inflight_pause_p99_s"] = max(p99) if p99 else None
    return out


_TIMES = ("time", "step_s", "wait_s", "train_s", "publish_s")
_WORKER_TIMES = ("busy_s", "uptime_s", "weight_apply_s", "busy_seq_s", "capacity_seq_s", "inflight_pause_p50_s",
                 "inflight_pause_p99_s", "leases_held_s", "poll_s", "idle_queued_seq_s", "idle_empty_seq_s",
                 "idle_no_lease_seq_s", "idle_slots_full_seq_s", "pause_seq_s", "credits_withheld_window_s",
                 "credits_withheld_capacity_s")


def modelled_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with every duration in modelled seconds: the simulator sleeps modelled time / ``time_scale`` and
    writes ``time_scale`` on each line (absent or 1: the rows are returned as they are)."""
    scale = rows[-1].get("time_scale", 1.0) if rows else 1.0
    if scale == 1.0:
        return rows
    out = []
    for r in rows:
        workers = {w: v | {k: v[k] * scale for k in _WORKER_TIMES if k in v}
                   for w, v in r["pipeline"]["workers"].items()}
        out.append(r | {k: r[k] * scale for k in _TIMES} | {"pipeline": r["pipeline"] | {"workers": workers}})
    return out


def analyze(rows: list[dict[str, Any]], *, warmup: int, group_size: int) -> dict[str, Any]:
    """Throughput, idleness, staleness, sync cost and the pipelining bound of one run.

    Args:
        rows: ``metrics.jsonl`` rows, one per step (the recipe's schema); simulated rows are converted to
            modelled seconds first (:func:`modelled_time`).
        warmup: leading steps left out; the counters' base is row ``warmup`` (so ``warmup >= 1``).
        group_size: rollouts per group (to count groups trained).

    Returns:
        Scalars (see ``SCALARS``) plus ``staleness_hist`` (summed), ``reward_series``
        (``[seconds since start, reward_mean]`` for every step), ``calibration`` inputs and ``modelled``
        (the simulator's keys, if present).

    Raises:
        ValueError: with fewer than ``warmup + 2`` rows.
    """
    if warmup < 1 or len(rows) < warmup + 2:
        raise ValueError(f"need warmup >= 1 and at least warmup + 2 steps, got {warmup=} and {len(rows)} rows")
    rows = modelled_time(rows)
    base, timed, last = rows[warmup - 1], rows[warmup:], rows[-1]
    wall = last["time"] - base["time"]
    rollouts = [sum(r["staleness_hist"]) for r in timed]
    n_rollouts, n_tokens = sum(rollouts), sum(r["tokens"] for r in timed)
    hist = [sum(col) for col in zip(*(r["staleness_hist"] for r in timed))]
    accepted = [r for r in timed if r["accepted"]]
    busy = sum(r["train_s"] + r["publish_s"] for r in timed)
    w = _worker_deltas(base["pipeline"], last["pipeline"])
    gen_capacity = _ratio(w["rollouts_sent"], w["busy_s"] / w["workers"]) if w["workers"] else None
    train_capacity = _ratio(n_rollouts, busy)
    rate = n_rollouts / wall
    capacities = [c for c in (gen_capacity, train_capacity) if c is not None]
    bound = min(capacities) if capacities else None
    start = rows[0]["time"] - rows[0]["step_s"]
    updates = w["updates_per_worker"] * w["workers"]
    tail = max(1, len(rows) // 5)
    dropped = last["pipeline"]["stale_dropped"] - base["pipeline"]["stale_dropped"]
    return occupancy_split(w) | {
        "rollouts_per_s": rate,
        "tokens_per_s": n_tokens / wall,
        "trainer_idle": _ratio(sum(r["wait_s"] for r in timed), sum(r["step_s"] for r in timed)),
        "worker_idle": 1 - w["busy_s"] / w["uptime_s"] if w["uptime_s"] > 0 else None,
        "weight_apply_share": _ratio(w["weight_apply_s"], w["uptime_s"]),
        "staleness_mean": sum(i * c for i, c in enumerate(hist)) / max(1, sum(hist)),
        "staleness_p50": _quantile(hist, 0.5),
        "staleness_p99": _quantile(hist, 0.99),
        "staleness_max": max(r["staleness_max"] for r in timed),
        "publish_s": statistics.mean(r["publish_s"] for r in accepted) if accepted else None,
        "weight_apply_s": _ratio(w["weight_apply_s"], updates),
        "regenerated_frac": dropped / (n_rollouts / group_size),
        "gen_capacity": gen_capacity,
        "train_capacity": train_capacity,
        "bound": bound,
        "efficiency": _ratio(rate, bound) if bound else None,
        "reward_first": statistics.mean(r["reward_mean"] for r in rows[:tail]),
        "reward_last": statistics.mean(r["reward_mean"] for r in rows[-tail:]),
        "wall_s": wall,
        # busy slot-time over available slot-time of the engines (workers.engines.base.Engine.occupancy)
        "occupancy": _ratio(w["busy_seq_s"], w["capacity_seq_s"]),
        "inflight_pause_p50_s": w["inflight_pause_p50_s"],
        "inflight_pause_p99_s": w["inflight_pause_p99_s"],
        "resubmitted_frac": w["groups_resubmitted"] / (n_rollouts / group_size),
        # streaming workers: mean leases held per worker (in the engine or waiting for weights), to set against
        # worker.slots and the staleness window ((k + 1) x batch_size per rank, leased or buffered)
        "leases_held": _ratio(w["leases_held_s"], w["uptime_s"]) if w["leases_held_s"] else None,
        # the pool's reasons for granting a worker none of its free credits, as shares of the workers' uptime
        "withheld_window": _ratio(w["credits_withheld_window_s"], w["uptime_s"]) if w["withheld"] else None,
        "withheld_capacity": _ratio(w["credits_withheld_capacity_s"], w["uptime_s"]) if w["withheld"] else None,
        "train_s_per_token": _ratio(sum(r["train_s"] for r in timed), n_tokens),
        "load_avg_1m": None,  # the sweep fills it in (the machine's load when the run ended)
        "staleness_hist": hist,
        "reward_series": [[round(r["time"] - start, 3), r["reward_mean"]] for r in rows],
        "calibration": {
            "gen_tokens_per_s_per_worker": _ratio(w["tokens_generated"], w["busy_s"]),
            "gen_rollouts_per_s_per_worker": _ratio(w["rollouts_sent"], w["busy_s"]),
            "train_s_per_token": _ratio(sum(r["train_s"] for r in timed), n_tokens),
            "train_s_per_rollout": _ratio(sum(r["train_s"] for r in timed), n_rollouts),
            "sync_s_per_byte": _ratio(sum(r["publish_s"] for r in accepted), sum(r["weight_bytes"] for r in accepted)),
            "weight_bytes": statistics.median(r["weight_bytes"] for r in accepted) if accepted else 0,
            "weight_apply_s": _ratio(w["weight_apply_s"], updates),
            "response_tokens_mean": _ratio(w["tokens_generated"], w["rollouts_sent"]),
            "tokens_per_rollout": n_tokens / n_rollouts,
        },
        "modelled": last.get("modelled"),
        "notes": [] if w["uptime_s"] > 0 else [
            "no worker counters in the window (they arrive with heartbeats): G and worker idle are unknown; "
            "run more steps"],
    }


def occupancy_split(w: dict[str, float]) -> dict[str, float | None]:
    """``OCCUPANCY_SPLIT`` of summed worker deltas, and ``outside_poll``: the share of the streaming workers' busy
    time their main thread spent outside ``engine.poll`` (an HF engine does not decode meanwhile)."""
    cap = w["capacity_seq_s"]
    out: dict[str, float | None] = dict.fromkeys(OCCUPANCY_SPLIT)
    out["outside_poll"] = 1 - w["poll_s"] / w["busy_s"] if w["poll_s"] and w["busy_s"] > 0 else None
    if not w.get("split") or cap <= 0:
        return out
    worker = w["idle_empty_seq_s"] - w["idle_no_lease_seq_s"] - w["idle_slots_full_seq_s"]
    for name, v in zip(OCCUPANCY_SPLIT, (w["busy_seq_s"], w["pause_seq_s"], w["idle_queued_seq_s"],
                                         w["idle_no_lease_seq_s"], w["idle_slots_full_seq_s"], worker)):
        out[name] = v / cap
    return out


def _stats(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize(runs: dict[tuple[int, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per point: median/min/max of every scalar over repeats, the ratios, and repeat 0's series.

    ``speedup`` divides a point's median rollouts/s by the ``max_staleness = 0`` point's with the same
    worker count (None without one); ``speedup_paired`` has median/min/max of the per-repeat ratios;
    ``efficiency_uncontended`` divides by that point's min(G, T) instead of this point's;
    ``window_bound`` = min(G, T, (k + 1) x the synchronous point's rollouts/s) (the staleness window: k + 1
    steps' groups in flight, each back after a whole engine call) and ``efficiency_window`` divides by it."""
    points = []
    for (k, w), reps in sorted(runs.items()):
        metrics = {name: _stats(r[name] for r in reps) for name in SCALARS}
        points.append({
            "max_staleness": k,
            "workers": w,
            "metrics": metrics,
            "staleness_hist": [sum(col) for col in zip(*(r["staleness_hist"] for r in reps))],
            "reward_series": reps[0]["reward_series"],
            "repeats": [{name: r[name] for name in SCALARS} | {"calibration": r["calibration"]} for r in reps],
            "modelled": reps[0]["modelled"],
            "notes": sorted({n for r in reps for n in r["notes"]}),
        })
    sync = {p["workers"]: p for p in points if p["max_staleness"] == 0}
    for p in points:
        ref = sync.get(p["workers"])
        rate = p["metrics"]["rollouts_per_s"]["median"]
        p["speedup"] = rate / ref["metrics"]["rollouts_per_s"]["median"] if ref else None
        # repeat r of this point against repeat r of the synchronous one (run back to back in the same sweep)
        pairs = zip(p["repeats"], ref["repeats"]) if ref else ()
        p["speedup_paired"] = _stats(a["rollouts_per_s"] / b["rollouts_per_s"] for a, b in pairs)
        p["efficiency"] = p["metrics"]["efficiency"]["median"]
        # against the capacities of the k = 0 point, where generation and training alternate and each has the
        # machine to itself: the bound that matters where they share cores (see the module docstring)
        sync_bound = ref["metrics"]["bound"]["median"] if ref else None
        p["efficiency_uncontended"] = rate / sync_bound if sync_bound else None
        # the staleness window: at most k + 1 steps' groups in flight, each back after a whole engine call, so
        # k + 1 steps per synchronous cycle at best: min(G, T, (k + 1) x the k = 0 throughput)
        window = (p["max_staleness"] + 1) * ref["metrics"]["rollouts_per_s"]["median"] if ref else None
        p["window_bound"] = min(p["metrics"]["bound"]["median"], window) if window else None
        p["efficiency_window"] = rate / p["window_bound"] if p["window_bound"] else None
    return points


def expected_longest(shape: dict[str, Any], rows: int, draws: int = 4000) -> float:
    """Mean longest response of an engine call of ``rows`` rows under the workload's length distribution
    (what a statically batched call decodes for); ``max_new_tokens`` for natural lengths or no tail."""
    if not shape.get("ignore_eos") or not shape.get("length_tail"):
        return float(shape["max_new_tokens"])
    median = shape["length_median"] or 2 * max(shape["min_new_tokens"], 1)
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(np.log(median), shape["length_tail"], size=(draws, rows))
    lengths = np.clip(lengths, max(shape["min_new_tokens"], 1), shape["max_new_tokens"]).astype(int)
    return float(lengths.max(axis=1).mean())


def calibration_summary(points: list[dict[str, Any]], shape: dict[str, Any]) -> dict[str, Any]:
    """What ``SimConfig.from_measured`` takes (the module docstring lists the keys): medians of each
    calibration input over the ``k = 0`` points' repeats (all points without one), the names ``SimConfig``
    uses, and the workload's shape."""
    sync = [p for p in points if p["max_staleness"] == 0]
    used = sync or points  # k = 0: generation and training alternate, each measured with the machine to itself
    cal = [r["calibration"] for p in used for r in p["repeats"]]
    summary: dict[str, Any] = {"version": 1, "calibrated_from": [[p["max_staleness"], p["workers"]] for p in used]}
    for key in cal[0] if cal else ():
        summary[key] = _stats(c[key] for c in cal)["median"]
    summary |= shape
    tokens, response = summary.pop("tokens_per_rollout", None), summary.get("response_tokens_mean")
    summary["prompt_tokens"] = tokens - response if tokens is not None and response is not None else None
    summary["publish_s_per_byte"] = summary.get("sync_s_per_byte")
    apply_s, nbytes = summary.get("weight_apply_s"), summary.get("weight_bytes")
    summary["apply_s_per_byte"] = apply_s / nbytes if apply_s is not None and nbytes else None
    rows = shape["max_batch"] * shape["group_size"]
    summary["rows_per_call"] = rows
    summary["longest_row_per_call"] = expected_longest(shape, rows)
    rate = summary.get("gen_rollouts_per_s_per_worker")
    summary["decode_tokens_per_s_per_sequence"] = rate / rows * summary["longest_row_per_call"] if rate else None
    return summary


# ----------------------------------------------------------------------------------------------------------------------
# measured mode: the real recipe under torchrun


def recipe_overrides(
    args: argparse.Namespace, max_staleness: int | str, workers: int | str, run_dir: Path | str,
    loop: str = "static", width: int | None = None,
) -> list[str]:
    """The dotted overrides of one measured point (the user's ``--set`` last, so they win); ``loop`` picks the
    workers' loop, ``width`` the engine's ``max_num_seqs`` (the same for both loops of a comparison)."""
    out = [f"run_dir={run_dir}", f"rollout.max_staleness={max_staleness}", f"rollout.num_workers={workers}",
           f"train.steps={args.steps}", "checkpoint.every=0", f"rollout.worker.engine.type={args.engine}",
           f"rollout.transport.heartbeat_s={HEARTBEAT_S}"]
    if loop == "streaming":
        out.append("rollout.worker.streaming=true")
        if getattr(args, "streaming_slots", None):
            out.append(f"rollout.worker.slots={args.streaming_slots}")
    if width is not None:
        out.append(f"rollout.worker.engine.max_num_seqs={width}")
    if not args.natural_lengths:
        out += ["rollout.worker.engine.ignore_eos=true", f"rollout.worker.engine.length_tail={args.length_tail}",
                f"rollout.worker.engine.length_median={args.length_median}",
                f"rollout.worker.engine.max_new_tokens={args.max_new_tokens}"]
        if args.min_new_tokens is not None:
            out.append(f"rollout.worker.engine.min_new_tokens={args.min_new_tokens}")
    if args.model:
        out.append(f"model.path={args.model}")
    return out + list(args.set)


def measured_runner(args: argparse.Namespace, loop: str = "static", width: int | None = None) -> RunPoint:
    from recipes.grpo import end_run  # kills a run's ranks by the pids they write
    def run(max_staleness: int, workers: int, repeat: int, run_dir: Path) -> Path:
        overrides = recipe_overrides(args, max_staleness, workers, run_dir, loop, width)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                str(RECIPE), "--config", str(args.config), *overrides]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        if args.threads:  # torch's intra-op threads of each rank (the recipe divides them among local ranks)
            env["OMP_NUM_THREADS"] = str(args.threads * args.ranks)
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "recipe.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                end_run(proc, run_dir)
                raise RuntimeError(f"k={max_staleness} w={workers}: recipe ran past --timeout={args.timeout}s; "
                                   f"log: {log}") from None
            except BaseException:  # Ctrl-C reaches only us (the run has a session of its own): end it too
                end_run(proc, run_dir)
                raise
        if rc != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"k={max_staleness} w={workers}: recipe exited {rc}; last output:\n{tail}")
        return run_dir / "metrics.jsonl"

    return run


def measured_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe config the points share (config file + ``--set``), for the calibration summary."""
    sys.path.insert(0, str(ROOT))
    from recipes.grpo import load_config

    cfg = load_config(str(args.config), recipe_overrides(args, 0, args.workers[0], Path("unused")))
    engine, worker = cfg.rollout.worker.engine, cfg.rollout.worker
    return {"engine": engine.type, "ignore_eos": engine.ignore_eos, "length_median": engine.length_median,
            "length_tail": engine.length_tail, "min_new_tokens": engine.min_new_tokens,
            "max_new_tokens": engine.max_new_tokens, "group_size": cfg.rollout.group_size,
            "batch_size": cfg.rollout.batch_size * args.ranks, "batch_size_per_rank": cfg.rollout.batch_size,
            "ranks": args.ranks, "max_batch": worker.max_batch, "slots": worker.slots}


def sim_shape(sim: Any) -> dict[str, Any]:
    """The simulated workload in the same terms as :func:`measured_shape`."""
    return {"engine": "fake", "ignore_eos": True, "length_median": sim.length_median, "length_tail": sim.length_tail,
            "min_new_tokens": sim.min_new_tokens, "max_new_tokens": sim.max_new_tokens, "group_size": sim.group_size,
            "batch_size": sim.batch_size, "batch_size_per_rank": sim.batch_size, "ranks": 1,
            "max_batch": sim.max_batch, "slots": sim.slots}


# ----------------------------------------------------------------------------------------------------------------------
# simulated mode: benchmarks.freshness_sim


_SIM_FLAGS = {  # CLI flag (argparse dest) -> SimConfig field
    "tokens_per_s": "tokens_per_s_per_worker",
    "train_s_per_token": "train_s_per_token",
    "sync_s_per_byte": "sync_s_per_byte",
    "weight_bytes": "weight_bytes",
    "length_median": "length_median",
    "length_tail": "length_tail",
    "min_new_tokens": "min_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "time_scale": "time_scale",
    "streaming_slots": "streaming_slots",
    "group_size": "group_size",
    "batch_size": "batch_size",
}


LONG_TAIL_SIM = {
    "tokens_per_s_per_worker": 40.0, "train_s_per_token": 3e-4, "length_median": 256, "length_tail": 1.0,
    "min_new_tokens": 16, "max_new_tokens": 4096, "prompt_tokens": 64, "group_size": 4, "batch_size": 8,
    "max_batch": 4, "slots": 8, "streaming_slots": 16, "weight_bytes": 14_000_000_000, "sync_s_per_byte": 1e-10,
    "load_s_per_byte": 5e-11,
    "time_scale": 50.0,
}
"""``--regime long-tail`` (simulated): a generation-bound reasoning-RL shape. Lognormal lengths (median 256,
sigma 1, clipped to [16, 4096]) decoded at 40 tokens/s per sequence (a 7B model on one GPU), 16 sequences per
engine (a static call: 4 leases x 4 samples; a static worker holds 8 leases, twice a call, a streaming one 16, so
its engine stays full while groups' last samples finish); a step of 32 rollouts (~15k tokens) trains in ~5 s and publishes
14 GB in 1.4 s, while one static call waits ~40 s for its longest row: the training step is far shorter than
the generation of a batch. Workers load an update in 0.7 s (the in-flight pause of a streaming worker).
Flags and ``--sim`` override each value; ``--calibrate`` replaces the rates it measured."""


def build_sim_config(args: argparse.Namespace) -> Any:
    """``SimConfig`` from ``--calibrate`` (a measured results JSON, or a bare summary) and/or the flags given;
    flags override the calibration; ``--regime long-tail`` supplies :data:`LONG_TAIL_SIM` for what is not given."""
    try:
        from benchmarks.freshness_sim import SimConfig
    except ImportError as e:
        raise SystemExit(f"simulated mode needs benchmarks/freshness_sim.py ({e}); measured mode works without it")
    fields = {f.name: f.type for f in dataclasses.fields(SimConfig)}  # types are strings (postponed annotations)
    given = {_SIM_FLAGS[k]: v for k, v in vars(args).items() if k in _SIM_FLAGS and v is not None}
    for item in args.sim:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--sim {item!r} must be FIELD=VALUE with a SimConfig field: {sorted(fields)}")
        given[name] = (int(float(raw)) if fields[name] == "int" else raw.lower() in ("1", "true", "yes")
                       if fields[name] == "bool" else float(raw))
    if args.regime == "long-tail" and not args.calibrate:
        given = LONG_TAIL_SIM | given
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise SystemExit(f"SimConfig has no field(s) {unknown}; its fields: {sorted(fields)}")
    if not args.calibrate:
        missing = [f"--{flag.replace('_', '-')}" for flag, name in _SIM_FLAGS.items()
                   if name in ("tokens_per_s_per_worker", "train_s_per_token") and name not in given]
        if missing:
            raise SystemExit(f"simulated mode needs --calibrate RESULTS.json or {' and '.join(missing)}")
        return SimConfig(**given)
    data = orjson.loads(Path(args.calibrate).read_bytes())
    return SimConfig.from_measured(data.get("calibration", data), **given)


def simulated_runner(args: argparse.Namespace, sim: Any) -> RunPoint:
    from benchmarks.freshness_sim import run_point

    def run(max_staleness: int, workers: int, repeat: int, run_dir: Path) -> Path:
        out = Path(run_point(sim, max_staleness=max_staleness, num_workers=workers, steps=args.steps, run_dir=run_dir))
        return out if out.is_file() else run_dir / "metrics.jsonl"

    return run


# ----------------------------------------------------------------------------------------------------------------------
# the sweep


def _group_size(config_json: Path, default: int) -> int:
    """The run's own ``rollout.group_size`` (the recipe writes ``config.json``), else ``default``."""
    if config_json.is_file():
        cfg = orjson.loads(config_json.read_bytes())
        return int((cfg.get("rollout") or cfg.get("sim") or {}).get("group_size", default))
    return default


def sweep(args: argparse.Namespace, runners: dict[str, RunPoint], group_size: int,
          work_dir: Path) -> list[dict[str, Any]]:
    """Every (max_staleness, workers) point of every loop, ``--repeats`` times, analysed and summarised; each point
    says its workers' ``loop``. Interleaved: repeat-major, then point by point, and at each point every loop in turn
    (static, then streaming), so slow drift in the machine's load (other jobs on shared cores) falls on both loops
    of a comparison alike; each run records the 1-minute load average when it ended (``load_avg_1m``). The static
    runs' dirs are ``work_dir/k{k}-w{w}-r{rep}``, the others' ``work_dir/{loop}/...``."""
    from tqdm import tqdm

    grid = [(k, w) for w in args.workers for k in args.staleness]
    runs: dict[str, dict[tuple[int, int], list[dict[str, Any]]]] = {loop: {p: [] for p in grid} for loop in runners}
    with tqdm(total=len(grid) * args.repeats * len(runners), desc=f"freshness {args.mode}", unit="run",
              disable=not sys.stderr.isatty()) as bar:
        for rep in range(args.repeats):
            for k, w in grid:
                for loop, run_point in runners.items():
                    bar.set_postfix(k=k, workers=w, repeat=rep, loop=loop)
                    run_dir = (work_dir if loop == "static" else work_dir / loop) / f"k{k}-w{w}-r{rep}"
                    path = run_dir / "metrics.jsonl" if args.reanalyze else run_point(k, w, rep, run_dir)
                    size = _group_size(path.parent / "config.json", group_size)
                    result = analyze(read_metrics(path), warmup=args.warmup, group_size=size)
                    result["load_avg_1m"] = None if args.reanalyze else os.getloadavg()[0]
                    runs[loop][(k, w)].append(result)
                    bar.update()
    return [p | {"loop": loop} for loop, by_point in runs.items() for p in summarize(by_point)]


def loop_comparison(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streaming against static at the same (max_staleness, workers), same engine, same run: the rollouts/s ratio
    (target >= 1.5 on the long tail), both engines' occupancy (target >= 0.9 streaming) and the in-flight pause."""
    static = {(p["max_staleness"], p["workers"]): p for p in points if p["loop"] == "static"}
    out = []
    for p in points:
        ref = static.get((p["max_staleness"], p["workers"]))
        if p["loop"] != "streaming" or ref is None:
            continue
        m, r = ({k: v["median"] for k, v in q["metrics"].items()} for q in (p, ref))
        both = {name: {"static": r.get(name), "streaming": m.get(name)} for name in (
            "occupancy", "staleness_mean", "regenerated_frac", "trainer_idle", "worker_idle", "gen_capacity",
            "train_capacity", "train_s_per_token", "load_avg_1m")}
        split = {name: m.get(name) for name in SPLIT_COLUMNS}
        out.append({"max_staleness": p["max_staleness"], "workers": p["workers"],
                    "rollouts_per_s": {"static": r["rollouts_per_s"], "streaming": m["rollouts_per_s"]},
                    "streaming_over_static": _ratio(m["rollouts_per_s"], r["rollouts_per_s"]),
                    # the repeats' own ratios (each streaming run against the static run just before it)
                    "streaming_over_static_paired": _stats(
                        a["rollouts_per_s"] / b["rollouts_per_s"] for a, b in zip(p.get("repeats", ()),
                                                                                   ref.get("repeats", ()))),
                    **both,
                    "inflight_pause_s": {"p50": m["inflight_pause_p50_s"], "p99": m["inflight_pause_p99_s"]},
                    "resubmitted_frac": m["resubmitted_frac"],
                    "leases_held": m.get("leases_held"),
                    "occupancy_split": split})
    return out


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """One line per (k, w): rollouts/s of both loops and their ratio, occupancy, the in-flight pause, regenerated
    groups, trainer idle (the window or generation binds when high), the streaming workers' mean leases held, and
    the load average at the end of each loop's run."""
    head = (f"{'k':>3} {'w':>3} {'static r/s':>10} {'stream r/s':>10} {'ratio':>6} {'occ static':>10} "
            f"{'occ stream':>10} {'pause p50/p99 s':>16} {'regen st/str':>13} {'tr.idle st/str':>14} {'leases':>6} "
            f"{'load st/str':>11}")
    lines = [head, "-" * len(head)]

    def pair(c: dict[str, Any], name: str, spec: str) -> str:
        v = c.get(name) or {}
        return f"{_fmt(v.get('static'), spec)}/{_fmt(v.get('streaming'), spec)}"

    for c in rows:
        pause = f"{_fmt(c['inflight_pause_s']['p50'], '.3f')}/{_fmt(c['inflight_pause_s']['p99'], '.3f')}"
        lines.append(f"{c['max_staleness']:>3} {c['workers']:>3} {_fmt(c['rollouts_per_s']['static'], '10.2f')} "
                     f"{_fmt(c['rollouts_per_s']['streaming'], '10.2f')} {_fmt(c['streaming_over_static'], '5.2f')}x "
                     f"{_fmt(c['occupancy']['static'], '10.2f')} {_fmt(c['occupancy']['streaming'], '10.2f')} "
                     f"{pause:>16} {pair(c, 'regenerated_frac', '.2f'):>13} {pair(c, 'trainer_idle', '.2f'):>14} "
                     f"{_fmt(c.get('leases_held'), '6.1f')} {pair(c, 'load_avg_1m', '.1f'):>11}")
    return "\n".join(lines)


def split_table(rows: list[dict[str, Any]]) -> str:
    """One line per (k, w): the streaming engines' available slot-time by cause (``OCCUPANCY_SPLIT``) and the share
    of their busy time the worker spent outside ``poll``, then the shares of the workers' uptime in which the pool
    withheld their free credits at the staleness window or at ``capacity``."""
    names = SPLIT_COLUMNS
    head = f"{'k':>3} {'w':>3} " + " ".join(f"{n.removeprefix('occ_'):>12}" for n in names)
    lines = [head, "-" * len(head)]
    for c in rows:
        lines.append(f"{c['max_staleness']:>3} {c['workers']:>3} "
                     + " ".join(_fmt(c["occupancy_split"].get(n), "12.3f") for n in names))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# outputs


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(points: list[dict[str, Any]]) -> str:
    """The compact table printed at the end (medians; ``eff0``: ``efficiency_uncontended``)."""
    head = (f"{'k':>3} {'w':>3} {'rollouts/s':>10} {'tokens/s':>9} {'speedup':>7} {'eff':>5} {'eff0':>5} {'G':>8} "
            f"{'T':>8} {'tr.idle':>7} {'wk.idle':>7} {'stale mean/p50/p99':>18} {'regen':>6} {'publish ms':>10} "
            f"{'reward':>11}")
    lines = [head, "-" * len(head)]
    for p in points:
        m = {k: v["median"] for k, v in p["metrics"].items()}
        stale = "/".join([_fmt(m["staleness_mean"], ".2f"), _fmt(m["staleness_p50"], ".0f"),
                          _fmt(m["staleness_p99"], ".0f")])
        reward = f"{_fmt(m['reward_first'], '.2f')}->{_fmt(m['reward_last'], '.2f')}"
        publish = None if m["publish_s"] is None else 1e3 * m["publish_s"]
        lines.append(
            f"{p['max_staleness']:>3} {p['workers']:>3} {_fmt(m['rollouts_per_s'], '10.1f')} "
            f"{_fmt(m['tokens_per_s'], '9.0f')} {_fmt(p['speedup'], '6.2f')}x {_fmt(m['efficiency'], '5.2f')} "
            f"{_fmt(p['efficiency_uncontended'], '5.2f')} {_fmt(m['gen_capacity'], '8.1f')} "
            f"{_fmt(m['train_capacity'], '8.1f')} {_fmt(m['trainer_idle'], '7.2f')} {_fmt(m['worker_idle'], '7.2f')} "
            f"{stale:>18} {_fmt(m['regenerated_frac'], '6.3f')} {_fmt(publish, '10.1f')} {reward:>11}")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``throughput.png`` (rollouts/s with min-max bars and the bound min(G, T), dashed; efficiency),
    ``reward_vs_wallclock.png`` and ``staleness_hist.png`` (one panel per setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    workers = sorted({p["workers"] for p in points})
    ks = sorted({p["max_staleness"] for p in points})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, w in enumerate(workers):
        ps = [p for p in points if p["workers"] == w]
        x = [p["max_staleness"] for p in ps]
        m = [p["metrics"]["rollouts_per_s"] for p in ps]
        err = [[v["median"] - v["min"] for v in m], [v["max"] - v["median"] for v in m]]
        line = a.errorbar(x, [v["median"] for v in m], yerr=err, marker="o", capsize=3, label=f"{w} workers")
        a.plot(x, [p["metrics"]["bound"]["median"] or math.nan for p in ps], ls="--", color=line[0].get_color(),
               alpha=0.6, label=f"{w} workers: min(G, T)")
        b.plot(x, [p["metrics"]["efficiency"]["median"] or math.nan for p in ps], marker="o", label=f"{w} workers")
    a.set(xlabel="max_staleness", ylabel="trained rollouts/s", title="throughput", xticks=ks)
    top = max([1.0] + [p["metrics"]["efficiency"]["median"] or 0 for p in points])
    b.axhline(1.0, color="grey", lw=0.8, ls=":")
    b.set(xlabel="max_staleness", ylabel="measured / min(G, T)", title="pipelining efficiency", xticks=ks,
          ylim=(0, 1.1 * top))
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    paths = [out_dir / "throughput.png"]
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in points:
        t, r = zip(*p["reward_series"])
        ax.plot(t, r, label=f"k={p['max_staleness']} w={p['workers']}", alpha=0.8)
    ax.set(xlabel="seconds since training start", ylabel="reward (batch mean)", title="reward vs wall-clock")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "reward_vs_wallclock.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(workers), len(ks), figsize=(2.6 * len(ks), 2.2 * len(workers)), squeeze=False)
    for p in points:
        ax = axes[workers.index(p["workers"])][ks.index(p["max_staleness"])]
        hist = p["staleness_hist"]
        total = max(1, sum(hist))
        top = max([i for i, c in enumerate(hist) if c] + [p["max_staleness"]]) + 1
        ax.bar(range(top), [c / total for c in hist[:top]])
        ax.set_title(f"k={p['max_staleness']} w={p['workers']}", fontsize=8)
        ax.set_xticks(range(top))
    fig.supxlabel("staleness (policy versions behind the trainer)")
    fig.supylabel("share of trained rollouts")
    fig.tight_layout()
    paths.append(out_dir / "staleness_hist.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------------------------------------------
# baseline: reference ratios of a short configuration


def baseline_ratios(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Speedups (k > 0 vs k = 0) and efficiencies of a run, each with its tolerance band beside it."""
    out: dict[str, dict[str, Any]] = {}
    for p in points:
        k, w = p["max_staleness"], p["workers"]
        if p["speedup"] is not None and k > 0:
            s = p["speedup"]
            out[f"speedup k={k} w={w}"] = {"value": round(s, 3), "tolerance": f"±{SPEEDUP_REL_TOL:.0%} relative",
                                          "low": round(s * (1 - SPEEDUP_REL_TOL), 3),
                                          "high": round(s * (1 + SPEEDUP_REL_TOL), 3)}
        if p["efficiency"] is not None:
            e = p["efficiency"]
            out[f"efficiency k={k} w={w}"] = {"value": round(e, 3), "tolerance": f">= value - {EFFICIENCY_ABS_TOL}",
                                             "low": round(e - EFFICIENCY_ABS_TOL, 3), "high": None}
    return out


def compare_to_baseline(points: list[dict[str, Any]], baseline: dict[str, Any]) -> list[str]:
    """Ratios of ``points`` outside the baseline's bands, as sentences (empty: all within)."""
    now = {name: r["value"] for name, r in baseline_ratios(points).items()}
    failures = []
    for name, ref in baseline["ratios"].items():
        got = now.get(name)
        if got is None:
            failures.append(f"{name}: missing from this run (baseline {ref['value']})")
        elif got < ref["low"] or (ref["high"] is not None and got > ref["high"]):
            failures.append(f"{name} = {got:.3f}, outside [{ref['low']}, {ref['high'] or 'inf'}] "
                            f"(baseline {ref['value']}, {ref['tolerance']})")
    return failures


def _baseline_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options that say where outputs go or what to do with the baseline."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--keep-runs"):
            skip = True
        elif not a.startswith(("--out=", "--keep-runs=")) and a not in ("--write-baseline", "--check-baseline",
                                                                       "--reanalyze"):
            out.append(a)
    return out


def refresh_command(argv: list[str]) -> str:
    return "python -m benchmarks.freshness " + " ".join(argv) + " --write-baseline"


# ----------------------------------------------------------------------------------------------------------------------
# CLI


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.freshness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--staleness", type=_ints, default=[0, 1, 2, 4], help="max_staleness values, e.g. 0,1,2,4")
    common.add_argument("--steps", type=int, default=40, help="trainer steps per point (warm-up included)")
    common.add_argument("--warmup", type=int, default=5, help="leading steps left out of every metric")
    common.add_argument("--repeats", type=int, default=1)
    common.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and the PNG folder go")
    common.add_argument("--keep-runs", type=Path, default=None, help="keep every point's run_dir under this folder")
    common.add_argument("--reanalyze", action="store_true",
                        help="run nothing: analyse the runs already under --keep-runs (same grid and repeats)")
    common.add_argument("--no-plots", action="store_true")
    common.add_argument("--write-baseline", action="store_true", help=f"write this run's ratios to {BASELINE}")
    common.add_argument("--check-baseline", action="store_true", help="exit 1 if a ratio left the baseline's band")
    common.add_argument("--length-median", type=int, default=None, help="median response tokens (lognormal)")
    common.add_argument("--length-tail", type=float, default=None, help="lognormal sigma of response lengths")
    common.add_argument("--min-new-tokens", type=int, default=None)
    common.add_argument("--max-new-tokens", type=int, default=None, help="longest response (the clip)")
    common.add_argument("--loops", type=lambda t: [x for x in t.split(",") if x], default=None,
                        help="the workers' loops to compare point by point, e.g. static,streaming (default: static; "
                             "with --regime long-tail: static,streaming)")
    common.add_argument("--streaming-slots", type=int, default=None,
                        help="worker.slots of the streaming loop (leases in its engine at once; default: the "
                             "static loop's, or the regime's)")
    common.add_argument("--regime", choices=["default", "long-tail"], default="default",
                        help="long-tail: the generation-bound regime (simulated: LONG_TAIL_SIM; lognormal lengths, "
                             "a training step shorter than a batch's generation) comparing static and streaming")

    m = sub.add_parser("measured", parents=[common], help="the real recipe under torchrun")
    m.add_argument("--workers", type=_ints, default=[1, 2], help="rollout workers per trainer rank, e.g. 1,2")
    m.add_argument("--ranks", type=int, default=1, help="trainer ranks (torchrun --nproc-per-node)")
    m.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    m.add_argument("--model", default=None, help="HF model directory (default: the embedded tiny Qwen2)")
    m.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    m.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. --set rollout.capacity=16 train.lr=0.001 (repeatable)")
    m.add_argument("--natural-lengths", action="store_true", help="keep EOS: no ignore_eos, no length overrides")
    m.add_argument("--threads", type=int, default=None,
                   help="torch threads per trainer rank (OMP_NUM_THREADS; default: torch's, i.e. the cores)")
    m.add_argument("--timeout", type=float, default=1800.0, help="seconds per point before the run is ended")

    s = sub.add_parser("simulated", parents=[common], help="benchmarks.freshness_sim: time-modelled engines/trainer")
    s.add_argument("--workers", type=_ints, default=[4, 16, 64])
    s.add_argument("--calibrate", type=Path, default=None, help="a measured results JSON (its 'calibration')")
    s.add_argument("--tokens-per-s", type=float, default=None, help="decode tokens/s of one sequence in a statically batched engine call (a call takes longest row / this)")
    s.add_argument("--train-s-per-token", type=float, default=None)
    s.add_argument("--sync-s-per-byte", type=float, default=None)
    s.add_argument("--weight-bytes", type=int, default=None)
    s.add_argument("--time-scale", type=float, default=None, help="modelled seconds per wall second: modelled durations are slept divided by this")
    s.add_argument("--group-size", type=int, default=None)
    s.add_argument("--batch-size", type=int, default=None, help="groups per step")
    s.add_argument("--sim", action="extend", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="any other SimConfig fields, e.g. --sim max_batch=2 slots=4 (repeatable; win over --calibrate)")
    return p


def _defaults_for_measured(args: argparse.Namespace) -> None:
    args.length_median = 24 if args.length_median is None else args.length_median
    args.length_tail = 1.0 if args.length_tail is None else args.length_tail
    args.max_new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.reanalyze and not args.keep_runs:
        raise SystemExit("--reanalyze needs --keep-runs DIR (where the earlier runs were kept)")
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise SystemExit(f"need --warmup >= 1 and --steps >= warmup + 2, got {args.warmup=} {args.steps=}")
    loops = args.loops or (["static", "streaming"] if args.regime == "long-tail" else ["static"])
    if set(loops) - {"static", "streaming"} or len(set(loops)) != len(loops):
        raise SystemExit(f"--loops {','.join(loops)}: each of 'static', 'streaming' at most once")
    if args.mode == "measured":
        _defaults_for_measured(args)
        shape = measured_shape(args)
        # both loops on the same engine: its sequence capacity is a static call's rows
        width = shape["max_batch"] * shape["group_size"] if "streaming" in loops else None
        config: dict[str, Any] = {"recipe_config": str(args.config),
                                  "recipe_overrides": recipe_overrides(args, "{k}", "{w}", "{run_dir}", "{loop}", width)}
        runners = {loop: measured_runner(args, loop, width) for loop in loops}
    else:
        sim = build_sim_config(args)
        shape = sim_shape(sim)
        config = {"sim": dataclasses.asdict(sim)}
        runners = {loop: simulated_runner(args, dataclasses.replace(sim, streaming=loop == "streaming"))
                   for loop in loops}
    config |= {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"argv": argv, "loops": loops}
    date = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="freshness-") as tmp:
        work = args.keep_runs or Path(tmp)
        points = sweep(args, runners, shape["group_size"], work)
    comparison = loop_comparison(points)
    result = {
        "benchmark": "freshness",
        "mode": args.mode,
        "date": date.isoformat(timespec="seconds"),
        "config": config,
        "machine": machine(),
        "git_commit": git_commit(),
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "points": points,
        "calibration": calibration_summary([p for p in points if p["loop"] == loops[0]],
                                           shape | {"workers_per_rank": args.workers}),
    }
    if comparison:
        result["streaming_vs_static"] = comparison
    regime = "" if args.regime == "default" else f"-{args.regime}"
    stem = f"freshness-{args.mode}{regime}-{date.date()}"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem}.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    pngs = [] if args.no_plots else [png for loop in loops for png in plot(
        [p for p in points if p["loop"] == loop], args.out / stem / loop if len(loops) > 1 else args.out / stem)]
    first = [p for p in points if p["loop"] == loops[0]]  # the baseline's ratios: one loop's (static by default)
    for loop in loops:
        print(f"loop: {loop}")
        print(table([p for p in points if p["loop"] == loop]))
    if comparison:
        print("streaming vs static (same staleness, same engine, same run):")
        print(comparison_table(comparison))
    # the split of every streaming point (a --loops streaming run has no comparison, and needs it as much)
    split = comparison or [{"max_staleness": p["max_staleness"], "workers": p["workers"],
                            "occupancy_split": {n: p["metrics"].get(n, {}).get("median") for n in SPLIT_COLUMNS}}
                           for p in points if p["loop"] == "streaming"]
    if any(c["occupancy_split"]["occ_busy"] is not None for c in split):
        print("streaming engines' slot-time (busy = occupancy; the rest: why rows were not busy):")
        print(split_table(split))
    for p in points:
        for note in p["notes"]:
            print(f"note (k={p['max_staleness']}, w={p['workers']}): {note}")
    print(f"calibration for SimConfig.from_measured: {orjson.dumps(result['calibration']).decode()}")
    print(f"wrote {path}" + (f" and {len(pngs)} plots in {args.out / stem}" if pngs else ""))
    if args.write_baseline:
        clean = _baseline_argv(argv)
        baseline = {"how_to_refresh": refresh_command(clean), "mode": args.mode, "argv": clean,
                    "date": result["date"], "git_commit": result["git_commit"], "machine": result["machine"],
                    "load_avg_1m": result["load_avg_1m"],
                    "ratios": baseline_ratios(first)}
        BASELINE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE.write_bytes(orjson.dumps(baseline, option=orjson.OPT_INDENT_2))
        print(f"wrote {BASELINE}")
    if args.check_baseline:
        baseline = orjson.loads(BASELINE.read_bytes())
        failures = compare_to_baseline(first, baseline)
        for line in failures:
            print(f"REGRESSION {line}")
        if failures:
            print(f"if the change is intended, refresh with: {baseline['how_to_refresh']}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
