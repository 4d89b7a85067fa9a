"""Does a recipe command learn? Reward over the first and the last window of steps, and the guard's verdicts, over
a few runs of each command, against the same measure of a baseline command in the same invocation.

    python -m benchmarks.recipe_learning --runs 3 --nproc 1 \\
        --candidate "lora.rank=8 train.lr=0.01" --candidate "lora.rank=8 train.lr=0.002"

Each candidate is a string of dotted overrides on ``--config`` (default ``recipes/configs/tiny_cpu.yaml``); the first
is the baseline. Run ``i`` of every candidate uses ``train.seed=first_seed+i`` (the tiny model, the warm start's draws), so
candidates are compared on the same seeds. Every run goes through ``torchrun recipes/grpo.py`` as written in the
recipe's docstring (plus ``run_dir``, the seed, ``debug.report=false`` and ``checkpoint.every=0``) and is read back
from its ``summary.json`` (:func:`asyncrl.debug.summary.run_summary`: the same windows the run printed). JSON with the
config, the machine and every run under ``benchmarks/results/``. Runs are asynchronous (``max_staleness`` of the run
file): numbers vary between runs, which is why there are several.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._report import machine

ROOT = Path(__file__).parents[1]


def one_run(config: Path, overrides: list[str], seed: int, nproc: int, run_dir: Path, timeout: float) -> dict:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(ROOT / "recipes" / "grpo.py"), "--config", str(config), *overrides, f"run_dir={run_dir}",
            f"train.seed={seed}", "debug.report=false", "checkpoint.every=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise RuntimeError(f"no summary.json after {shlex.join(argv)} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    s = json.loads(summary_path.read_text())
    return {"seed": seed, "exit_code": done.returncode, "wall_s": wall, "verdict": s["verdict"],
            "steps": s["steps"]["total"], "accepted": s["updates"]["accepted"], "rejected": s["updates"]["rejected"],
            "rejected_by": {k: v["count"] for k, v in s["updates"]["rejected_by"].items()},
            "reward_window": s["reward"]["window"], "reward_first": s["reward"]["first"],
            "reward_last": s["reward"]["last"], "reward_change": s["reward"]["change"],
            "rollouts_per_s": s["throughput"]["rollouts_per_s"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "recipes" / "configs" / "tiny_cpu.yaml")
    p.add_argument("--candidate", action="append", required=True, help="dotted overrides, quoted; the first: baseline")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run i uses train.seed=first_seed+i")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="recipe_learning-") as tmp:
        for c, cand in enumerate(args.candidate):
            runs = []
            for seed in range(args.first_seed, args.first_seed + args.runs):
                run = one_run(args.config, shlex.split(cand), seed, args.nproc, Path(tmp) / f"c{c}-s{seed}", args.timeout)
                print(f"[{cand}] seed {seed}: reward {run['reward_first']:.3f} -> {run['reward_last']:.3f} "
                      f"({run['reward_change']:+.3f}), {run['rejected']}/{run['steps']} rejected, "
                      f"exit {run['exit_code']}, {run['wall_s']:.0f} s", flush=True)
                runs.append(run)
            results.append({
                "overrides": cand, "runs": runs,
                "reward_change_mean": statistics.mean(r["reward_change"] for r in runs),
                "reward_change_min": min(r["reward_change"] for r in runs),
                "rejected_fraction_mean": statistics.mean(r["rejected"] / r["steps"] for r in runs),
            })
    base = results[0]
    for r in results:
        r["reward_change_vs_baseline"] = r["reward_change_mean"] - base["reward_change_mean"]
    date = dt.datetime.now(dt.timezone.utc)
    out = args.out or ROOT / "benchmarks" / "results" / f"recipe_learning-{date:%Y-%m-%d}.json"
    out.write_text(json.dumps({
        "benchmark": "recipe_learning", "date": date.isoformat(), "machine": machine(),
        "config": {"run_file": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
                   "nproc": args.nproc, "runs": args.runs, "first_seed": args.first_seed,
                   "baseline": base["overrides"]},
        "candidates": results,
    }, indent=2))
    print(out)


if __name__ == "__main__":
    main()
