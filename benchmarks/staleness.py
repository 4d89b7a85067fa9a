"""Wall-clock per trained sample of the embedded recipe for max_staleness 0, 1 and 2 (CPU).

    python -m benchmarks.staleness [--steps 60] [--repeats 1]

Runs ``recipes/grpo.py`` with ``recipes/configs/tiny_cpu.yaml`` under torchrun (2 ranks) once per
setting and repeat, and reads ``metrics.jsonl``: seconds per trained rollout over the steps after a
warm-up (the first 5 steps are excluded), mean staleness, and the final reward. The baseline is
``max_staleness=0`` (synchronous) measured in the same run. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._report import machine

ROOT = Path(__file__).parents[1]
WARMUP_STEPS = 5


def run(staleness: int, steps: int, run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "recipes" / "grpo.py"), "--config", str(ROOT / "recipes" / "configs" / "tiny_cpu.yaml"),
            f"run_dir={run_dir}", f"rollout.max_staleness={staleness}", f"train.steps={steps}", "checkpoint.every=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP_STEPS:]
    seconds = timed[-1]["time"] - rows[WARMUP_STEPS - 1]["time"]
    rollouts = len(timed) * 2 * 8 * 8  # steps x ranks x groups per rank x group size (tiny_cpu.yaml)
    return {
        "seconds_per_rollout": seconds / rollouts,
        "rollouts_per_s": rollouts / seconds,
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in timed),
        "reward_last10": statistics.mean(r["reward_mean"] for r in rows[-10:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--settings", default="0,1,2")
    args = p.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for k in map(int, args.settings.split(",")):
                r = run(k, args.steps, Path(tmp) / f"k{k}-r{rep}")
                results.setdefault(str(k), []).append(r)
                print(f"max_staleness={k} repeat {rep}: {r['rollouts_per_s']:.0f} rollouts/s, "
                      f"{1e3 * r['seconds_per_rollout']:.2f} ms/rollout, staleness {r['staleness_mean']:.2f}")
    summary = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in results.items()}
    base = summary["0"]["seconds_per_rollout"] if "0" in summary else None
    for s in summary.values():
        s["speedup_vs_sync"] = base / s["seconds_per_rollout"] if base else None
    out = {
        "benchmark": "staleness",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": vars(args) | {"recipe_config": "recipes/configs/tiny_cpu.yaml", "warmup_steps": WARMUP_STEPS},
        "machine": machine(),
        "metrics": summary,
        "repeats": results,
    }
    path = ROOT / "benchmarks" / "results" / f"staleness-{dt.date.today()}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
