"""The same tiny run launched by torchrun and by Ray, in one invocation: rollouts/s, and how soon a node that joins
contributes.

    python -m benchmarks.cluster_launch [--steps 300] [--warmup 30] [--rounds 3] [--out results/cluster_launch-DATE.json]

Both launches run ``recipes/configs/tiny_cpu.yaml`` (the tiny model, HF workers, 2 trainer ranks, gloo) with the same
overrides and two rollout workers:

* ``torchrun``: ``torchrun --standalone --nproc-per-node 2`` with one local worker per rank (``rollout.num_workers=1``,
  shared-memory weights): today's path (``asyncrl launch --engine local``);
* ``ray``: ``asyncrl launch --engine ray``'s supervisor on a Ray cluster of fake nodes on this machine
  (:mod:`asyncrl.integrations.ray.fake`: a head and two nodes, each with one trainer bundle and one rollout worker,
  Ray's workers at niceness 0 as torchrun's processes are); the workers take their weights by locality (the relay's
  shared memory on rank 0's node, zmq on the other: full versions, the fake nodes sharing rank 0's address, see
  ``cluster.fleet.delta``), with the supervisor's and the transport's default settings.

Rollouts/s is the number of rollouts trained from step ``--warmup`` to step ``--steps`` over the wall time between
them (``metrics.jsonl``), so start-up is not counted; the ratio is Ray's over torchrun's in the same round, and the
one reported the median of ``--rounds`` rounds (a window of seconds on shared cores moves from one run to the next).
The Ray run is given more steps and goes on past that window for the joining node below, then is stopped. Then, in
the Ray run, a third node with the rollout resource is added (``cluster.add_node``) and the seconds until the first
group from its worker is trained (``consumed-rank*.jsonl``) are measured: ``add_node`` to the node seen, to its
worker started, to its first group trained. On one machine the fake nodes share the CPUs: the numbers are what this
machine does, not a cluster's.
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
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine

ROOT = Path(__file__).resolve().parents[1]
RUN_FILE = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


def _overrides(run_dir: Path, steps: int) -> list[str]:
    return [f"run_dir={run_dir}", f"train.steps={steps}", "train.sft_steps=0", "train.threads=1", "checkpoint.every=0",
            "data.num_prompts=4096", "rollout.batch_size=4", "rollout.wait_timeout_s=300", "debug.report=false"]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _rate(run_dir: Path, warmup: int, last: int) -> dict[str, Any]:
    metrics = [m for m in _jsonl(run_dir / "metrics.jsonl") if warmup <= m["step"] <= last]
    if len(metrics) < 2:
        raise RuntimeError(f"{run_dir}: fewer than 2 steps in [{warmup}, {last}]")
    rollouts = sum(len(r["group_ids"]) for rank in range(2) for r in _jsonl(run_dir / f"consumed-rank{rank}.jsonl")
                   if warmup < r["step"] <= last) * 8  # group_size of tiny_cpu.yaml
    seconds = metrics[-1]["time"] - metrics[0]["time"]
    return {"rollouts": rollouts, "seconds": seconds, "rollouts_per_s": rollouts / seconds,
            "steps": [metrics[0]["step"], metrics[-1]["step"]],
            "staleness_max": max(m["staleness_max"] for m in metrics)}


def run_torchrun(work: Path, steps: int, warmup: int) -> dict[str, Any]:
    run_dir = work / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "recipes" / "grpo.py"), "--config",
           str(RUN_FILE), *_overrides(run_dir, steps), "rollout.num_workers=1"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"torchrun failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return {"wall_s": time.monotonic() - t0, **_rate(run_dir, warmup, steps)}


def run_ray(work: Path, steps: int, warmup: int, extra: list[str] = (), name: str = "ray") -> dict[str, Any]:
    from asyncrl.config import load_config
    from asyncrl.integrations.ray.fake import fake_cluster, node_args
    from asyncrl.integrations.ray.supervisor import RaySupervisor, run_tree

    run_dir = work / name
    # steps to spare after the timed window: the run goes on until the joining node's first group is trained, then
    # the supervisor is stopped
    # the same overrides as torchrun's, plus where the ranks go: the supervisor's, the heartbeats' and the fleet's
    # settings are their defaults
    overrides = [*_overrides(run_dir, steps * 20), "cluster.engine=ray", "cluster.node_ip=127.0.0.1",
                 "cluster.trainer.nnodes=2", *extra]
    cfg = load_config(str(RUN_FILE), overrides)
    trainer_node = node_args(2, 2, asyncrl_trainer=1, asyncrl_rollout=1)  # a GPU for the rank, one for the worker
    with fake_cluster({"a": trainer_node, "b": trainer_node}) as (cluster, _):
        sup = RaySupervisor(cfg, run_tree(str(RUN_FILE), overrides), recipe=str(ROOT / "recipes" / "grpo.py"),
                            pythonpath=[str(ROOT)])
        result: list[Any] = []
        t0 = time.monotonic()
        thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
        thread.start()
        steady_end = steps  # the rate is measured over the same steps as torchrun's, before the third node joins
        while _lines(run_dir / "metrics.jsonl") < steady_end and not result:
            time.sleep(0.5)  # counted, not parsed: parsing a growing metrics file 10 times a second cost 4% of a CPU
        if result:
            raise RuntimeError(f"the Ray run ended early: {result}")
        t_add = time.monotonic()
        node = cluster.add_node(**node_args(1, 1, asyncrl_rollout=1))
        events = lambda: _jsonl(run_dir / "cluster" / "events.jsonl")  # noqa: E731
        seen = started = trained = None
        worker = None
        deadline = t_add + 180
        while trained is None and time.monotonic() < deadline and not result:
            now = time.monotonic()
            if seen is None and any(e["event"] == "node_added" and e["node_id"] == node.node_id for e in events()):
                seen = now - t_add
            if worker is None:
                worker = next((e["worker_id"] for e in events() if e["event"] == "worker_started"
                               and e["node_id"] == node.node_id), None)
                if worker is not None:
                    started = now - t_add
            elif any(worker in r.get("workers", []) for rank in range(2)
                     for r in _jsonl(run_dir / f"consumed-rank{rank}.jsonl")):
                trained = now - t_add
            time.sleep(0.05)
        sup.request_stop()
        thread.join(120)
        if result != [130]:
            raise RuntimeError(f"the Ray run failed: {result}; logs in {run_dir / 'cluster' / 'logs'}")
        return {"wall_s": time.monotonic() - t0, **_rate(run_dir, warmup, steady_end),
                "add_node": {"node_seen_s": seen, "worker_started_s": started, "first_group_trained_s": trained}}


def _new_result_path(stem: str) -> Path:
    """``benchmarks/results/STEM.json``, or ``STEM-2.json``, ``STEM-3.json``, ...: an earlier result is never
    overwritten (the docs' tables are generated from these files)."""
    results = ROOT / "benchmarks" / "results"
    path, n = results / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = results / f"{stem}-{n}.json"
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of the torchrun run; the timed window of both")
    p.add_argument("--warmup", type=int, default=30, help="steps not timed (start-up, the first weights)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of torchrun then Ray (then the variants); the ratio "
                   "reported is the median of the rounds' ratios, each against its own round's torchrun")
    p.add_argument("--ray-variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="another Ray launch with these overrides, measured the same way (repeatable), e.g. "
                   "'cluster.fleet.delta=true'")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="asyncrl-cluster-launch-") as tmp:
        for n in range(args.rounds):
            work = Path(tmp) / f"round{n}"
            runs = {"torchrun": run_torchrun(work, args.steps, args.warmup),
                    "ray": run_ray(work, args.steps, args.warmup)}
            for i, variant in enumerate(args.ray_variant):
                runs[f"ray {variant}"] = run_ray(work, args.steps, args.warmup, variant.split(), name=f"ray-{i}")
            rounds.append(runs)
            print(f"round {n + 1}: " + ", ".join(f"{name} {run['rollouts_per_s']:.1f}" for name, run in runs.items()),
                  file=sys.stderr)
    names = [name for name in rounds[0] if name != "torchrun"]
    per_round = {f"{name} / torchrun rollouts_per_s": [r[name]["rollouts_per_s"] / r["torchrun"]["rollouts_per_s"]
                                                       for r in rounds] for name in names}
    key = "ray / torchrun rollouts_per_s"
    median_round = rounds[sorted(range(len(rounds)), key=lambda i: per_round[key][i])[len(rounds) // 2]]
    result = {
        "benchmark": "cluster_launch", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {"run_file": str(RUN_FILE.relative_to(ROOT)), "steps": args.steps, "warmup": args.warmup,
                   "rounds": args.rounds, "overrides": _overrides(Path("RUN_DIR"), args.steps), "ranks": 2,
                   "workers": 2},
        "machine": machine(), "load_average": {"before": load0, "after": os.getloadavg()},
        "metrics": median_round,  # the round whose Ray ratio is the median
        "ratios": {k: statistics.median(v) for k, v in per_round.items()},
        "ratios_per_round": per_round,
        "add_node_per_round": [r["ray"]["add_node"] for r in rounds],
        "rounds": rounds,
    }
    out = Path(args.out) if args.out else _new_result_path(f"cluster_launch-{dt.date.today().isoformat()}")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ray / torchrun rollouts/s: {result['ratios'][key]:.2f}x (median; rounds "
          f"{', '.join(f'{v:.2f}' for v in per_round[key])}); add_node -> first group trained "
          f"{median_round['ray']['add_node']['first_group_trained_s']} s; {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
