"""HF engine, streamed against static generation on a long-tailed workload: rollouts/s and engine occupancy.

The same engine config and the same groups (``--groups`` prompts x ``--group-size`` samples, ``engine.ignore_eos``
with lognormal lengths: ``--length-median``, ``--length-tail``, ``--max-new-tokens``) are generated two ways, one
after the other in one process, alternating over ``--repeats`` rounds:

  static    ``engine.generate`` on ``--max-batch`` groups per call (the static worker loop): each call decodes to
            its longest row, every group of a call returns with it;
  streamed  ``engine.submit`` / ``engine.poll`` (the streaming worker loop) with ``engine.max_num_seqs = max_batch
            x group_size`` (the same rows decoding at once) and ``--slots`` groups in flight (default 4 x max_batch, as
            the freshness benchmark's long-tail regime gives a streaming worker): a group leaves as its own samples
            finish, the next one is submitted at once, and its samples wait in the engine's queue for a free row,
            so a row freed by a short sample is refilled. With few groups in flight the queue runs dry while each
            group waits for its longest sample (2 x max_batch: occupancy ~0.8 here, 4 x: ~0.95).

Rollouts/s count generated samples over wall time; occupancy is the engine's own
(:meth:`~workers.engines.base.Engine.occupancy`: busy sequence-seconds over W x seconds with work), over the whole
run and up to the moment the last request is submitted (``occupancy_steady``: a worker fed by a pool never drains;
this finite workload ends with its longest samples decoding alone). Tokens/s count generated response tokens.
The tiny model on a CPU is dominated by per-step overhead, so a decode step costs about the same at any batch
width: what streaming saves here is the steps the static batch spends on its longest rows (a larger model on a GPU
behaves alike while the batch is memory-bound).

    .venv/bin/python -m benchmarks.hf_streaming [--groups 32] [--group-size 4] [--max-batch 4] [--slots 16]
        [--repeats 2] [--length-median 16 --length-tail 1.0 --max-new-tokens 128] [--model DIR] [--out x.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_static", "run_streamed"]


def _requests(groups: int, group_size: int) -> list[Any]:
    from workers.engines.base import GenerationRequest

    return [GenerationRequest(epoch=0, prompt_index=i, prompt={"prompt_ids": [1] + [10 + (i + j) % 100 for j in
                                                                                range(4 + i % 5)]}, n=group_size)
            for i in range(groups)]


def _occupancy(engine: Any, before: dict[str, float]) -> float | None:
    after = engine.occupancy()
    capacity = after["capacity_seq_s"] - before["capacity_seq_s"]
    return (after["busy_seq_s"] - before["busy_seq_s"]) / capacity if capacity > 0 else None


def run_static(engine: Any, requests: list[Any], max_batch: int) -> dict[str, Any]:
    """``max_batch`` requests per ``generate`` call, one call after another."""
    before, t0, tokens = engine.occupancy(), time.perf_counter(), 0
    for i in range(0, len(requests), max_batch):
        for cs in engine.generate(requests[i : i + max_batch]):
            tokens += sum(c.response_ids.numel() for c in cs)
    wall = time.perf_counter() - t0
    occupancy = _occupancy(engine, before)
    return {"wall_s": wall, "tokens": tokens, "occupancy": occupancy, "occupancy_steady": occupancy}


def run_streamed(engine: Any, requests: list[Any], slots: int) -> dict[str, Any]:
    """Up to ``slots`` requests in flight; a finished one is replaced by the next at once."""
    before, t0, tokens = engine.occupancy(), time.perf_counter(), 0
    pending, done, steady = list(enumerate(requests)), 0, None
    while done < len(requests):
        while pending and engine.in_flight() < slots:
            key, r = pending.pop(0)
            engine.submit(key, r)
        if not pending and steady is None:  # the last request is in: from here the batch drains
            steady = _occupancy(engine, before)
        for f in engine.poll(0.1):
            if f.error is not None or f.aborted:
                raise RuntimeError(f"request {f.key} did not finish: {f.error!r} aborted={f.aborted}")
            tokens += sum(c.response_ids.numel() for c in f.completions)
            done += 1
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "occupancy": _occupancy(engine, before), "occupancy_steady": steady}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from asyncrl.config import HFEngineConfig
    from asyncrl.testing.tiny_model import build_tiny_model
    from workers.engines import build_engine

    model = args.model or str(build_tiny_model(Path(tempfile.mkdtemp(prefix="asyncrl-hf-stream-")) / "tiny"))
    config = HFEngineConfig(model=model, seed=0, temperature=1.0, ignore_eos=True,
                          length_tail=args.length_tail, length_median=args.length_median, min_new_tokens=1,
                          max_new_tokens=args.max_new_tokens, max_num_seqs=args.max_batch * args.group_size)
    requests = _requests(args.groups, args.group_size)
    samples: dict[str, list[dict[str, Any]]] = {"static": [], "streamed": []}
    runs = (("static", run_static, args.max_batch), ("streamed", run_streamed, args.slots or 4 * args.max_batch))
    for _mode, fn, width in runs:  # warm-up, not recorded
        fn(build_engine(config), requests[: args.max_batch], width)
    for _ in range(args.repeats):
        for mode, fn, width in runs:
            r = fn(build_engine(config), requests, width)
            r["rollouts_per_s"] = len(requests) * args.group_size / r["wall_s"]
            r["tokens_per_s"] = r["tokens"] / r["wall_s"]
            samples[mode].append(r)
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in ("rollouts_per_s", "tokens_per_s", "occupancy",
                                                                       "occupancy_steady", "wall_s")}
               for mode, rs in samples.items()}
    summary["speedup"] = summary["streamed"]["rollouts_per_s"] / summary["static"]["rollouts_per_s"]
    return {"config": vars(args), "samples": samples, "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=4, help="groups per static call = groups in flight streamed")
    p.add_argument("--slots", type=int, default=None, help="groups in flight streamed (default 4 x max_batch)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--length-median", type=int, default=16)
    p.add_argument("--length-tail", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny Qwen2 model)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from benchmarks._report import git_commit, machine

    result = {"benchmark": "hf_streaming", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "machine": machine(), "load_avg": os.getloadavg(), **measure(args)}
    s = result["summary"]
    for mode in ("static", "streamed"):
        m = s[mode]
        print(f"{mode:9s} {m['rollouts_per_s']:8.1f} rollouts/s {m['tokens_per_s']:8.0f} tokens/s "
              f"occupancy {m['occupancy']:.2f} (before the drain {m['occupancy_steady']:.2f}) wall {m['wall_s']:.1f} s")
    print(f"speedup {s['speedup']:.2f}x (load {result['load_avg'][0]:.1f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
