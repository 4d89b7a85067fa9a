"""Weight fan-out: broadcaster bytes per update, and time until every worker holds it, per number of nodes, with and
without a per-node relay (``weights.relay``, :mod:`asyncrl.weights.relay`).

    python -m benchmarks.weight_fanout --mb 64 --nodes 1,2,4 --workers-per-node 2 --repeats 5

Method. The broadcaster (``zmq`` over loopback TCP, as a trainer serving other machines) runs in this process. A
simulated node is a relay process (``asyncrl relay --no-supervise``, with a directory of its own under ``/dev/shm``)
and ``--workers-per-node`` worker processes (``benchmarks/_relay_node.py``: the receiver ``run_worker`` opens, a copy
into the worker's own tensors like an engine's load, then the commit). Without the relay the same worker processes
pull from the broadcaster directly. Per update: from ``publish()`` until the last worker committed (each worker stamps
its commit with ``time.monotonic()``, one clock for every process of the machine) and, with the relay, until every
relay committed upstream (the node holds it); bytes from the broadcaster's counters; CPU seconds of every process of
the case (user + system, from ``/proc``). Two warm-up updates (the first copy everywhere, buffers and segments
allocated), then ``--repeats`` timed ones; medians, with every sample in the JSON.

On one machine every simulated node shares the same cores, where real nodes have their own: the time columns measure
the CPU the fan-out costs as much as its latency, and the ratio of 4 nodes to 1 grows with the CPU that 4 nodes' work
takes from 2 cores. The bytes are exact.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.weights import ZmqWeightBroadcaster
from asyncrl.weights import _relay_dir as rd
from benchmarks._report import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
NODE = Path(__file__).with_name("_relay_node.py")
TIMEOUT_S = 300.0
TARGET_TIME_RATIO = 1.5
"""The target: with the relay, time at 4 nodes <= 1.5x the time at 1 node."""


def model(mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(mb)}  # 1 MiB tensors


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def cpu_s(pids: list[int]) -> float:
    """User + system seconds of ``pids`` so far (their threads included), from ``/proc``."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Case:
    """One configuration's processes: the relays (``relay``) and the workers, and the commits the workers report."""

    def __init__(self, address: str, nodes: int, per_node: int, relay: bool, root: Path, logs: Path):
        self.procs: list[subprocess.Popen] = []
        self.commits: queue.Queue[dict] = queue.Queue()
        self.relay_ids = [f"relay-{k}" for k in range(nodes)] if relay else []
        self.workers = [f"n{k}w{i}" for k in range(nodes) for i in range(per_node)]
        for k, relay_id in enumerate(self.relay_ids):
            argv = [sys.executable, "-m", "asyncrl.cli", "relay", "--connect", address, "--serve-shm",
                    str(root / f"node{k}"), "--relay-id", relay_id, "--no-supervise"]
            self._spawn(argv, logs / f"{relay_id}.log", read=False)
        for k in range(nodes if relay else 0):
            deadline = time.monotonic() + TIMEOUT_S
            while not rd.look(root / f"node{k}").up:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"relay of node {k} did not come up; see {logs}")
                time.sleep(0.05)
        for k in range(nodes):
            for i in range(per_node):
                argv = [sys.executable, str(NODE), "--address", address, "--ids", f"n{k}w{i}"]
                argv += ["--relay", str(root / f"node{k}")] if relay else []
                self._spawn(argv, logs / f"n{k}w{i}.log", read=True)

    def _spawn(self, argv: list[str], log: Path, read: bool) -> None:
        with open(log, "w") as err:
            p = subprocess.Popen(argv, stdout=subprocess.PIPE if read else subprocess.DEVNULL, stderr=err, text=True,
                                 env=env())
        self.procs.append(p)
        if read:
            threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            event = json.loads(line)
            if event["event"] == "committed":
                self.commits.put(event)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_all(self, b: ZmqWeightBroadcaster, version: int, t0: float) -> tuple[float, float | None]:
        """Seconds from ``t0`` until every worker committed ``version``, and until every relay did (None: no relay)."""
        seen: dict[str, float] = {}
        nodes_at = None if self.relay_ids else 0.0
        deadline = time.monotonic() + TIMEOUT_S
        while len(seen) < len(self.workers) or nodes_at is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version}: {len(seen)} of {len(self.workers)} workers committed")
            try:
                e = self.commits.get(timeout=0.002)
                if e["version"] == version:
                    seen[e["worker"]] = e["t"]
            except queue.Empty:
                pass
            if nodes_at is None:
                committed = b.committed()
                if all(committed.get(r) == version for r in self.relay_ids):
                    nodes_at = time.monotonic() - t0
        return max(seen.values()) - t0, (nodes_at if self.relay_ids else None)

    def close(self) -> None:
        for p in reversed(self.procs):  # workers first, then their relays
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def run_case(nodes: int, relay: bool, args: argparse.Namespace, models: list[dict[str, torch.Tensor]],
             logs: Path) -> dict[str, Any]:
    size = sum(t.nbytes for t in models[0].values())
    b = ZmqWeightBroadcaster(bucket_bytes=args.bucket_mb << 20)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="asyncrl-fanout-", dir=base) as root:
        case = None
        try:
            b.publish(models[0], 0)
            case = Case(b.address, nodes, args.workers_per_node, relay, Path(root), logs)
            case.wait_all(b, 0, time.monotonic())
            samples = []
            for v in range(1, args.repeats + 3):
                before, cpu0 = b.stats()["bytes_served"], cpu_s(case.pids) + time.process_time()
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                b.publish(models[v % len(models)], v)
                latency, nodes_s = case.wait_all(b, v, t0)
                cpu = cpu_s(case.pids) + time.process_time() - cpu0
                sample = {"version": v, "latency_s": latency, "nodes_hold_s": nodes_s, "cpu_s": cpu,
                          "bytes": b.stats()["bytes_served"] - before, "loadavg_1m": load, "warmup": v <= 2}
                samples.append(sample)
        finally:
            if case is not None:
                case.close()
            b.close()
    timed = [s for s in samples if not s["warmup"]]
    bytes_per_update = statistics.median(s["bytes"] for s in timed)
    out = {"nodes": nodes, "workers": nodes * args.workers_per_node, "relay": relay, "size_bytes": size,
           "bytes_per_update": bytes_per_update, "bytes_over_size": bytes_per_update / size,
           "latency_s": summary([s["latency_s"] for s in timed]), "cpu_s": summary([s["cpu_s"] for s in timed]),
           "samples": samples}
    if relay:
        out["nodes_hold_s"] = summary([s["nodes_hold_s"] for s in timed])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="model size in MiB (float32, 1 MiB tensors)")
    p.add_argument("--bucket-mb", type=int, default=8)
    p.add_argument("--nodes", default="1,2,4", help="simulated node counts")
    p.add_argument("--workers-per-node", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed updates per case (after 2 warm-up updates)")
    p.add_argument("--paths", default="relay,direct", help="relay, direct or both")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(n) for n in args.nodes.split(",")]
    paths = args.paths.split(",")
    models = [model(args.mb, seed) for seed in (1, 2)]
    results: dict[str, dict[str, Any]] = {path: {} for path in paths}
    with tempfile.TemporaryDirectory(prefix="weight-fanout-logs-") as logs:
        for n in counts:
            for path in paths:
                r = run_case(n, path == "relay", args, models, Path(logs))
                results[path][str(n)] = r
                extra = f", nodes hold it in {r['nodes_hold_s']['median']:.3f} s" if path == "relay" else ""
                print(f"{n} node(s) x {args.workers_per_node}, {path}: {r['bytes_per_update'] / 1e6:.1f} MB per "
                      f"update ({r['bytes_over_size']:.2f}x the model), every worker in "
                      f"{r['latency_s']['median']:.3f} s{extra}, {r['cpu_s']['median']:.2f} CPU s", flush=True)
    ratios: dict[str, Any] = {}
    if "relay" in results:
        rel = results["relay"]
        ratios["relay_bytes_over_nodes_x_size"] = {n: r["bytes_per_update"] / (r["nodes"] * r["size_bytes"])
                                                   for n, r in rel.items()}
        lo, hi = str(min(counts)), str(max(counts))
        if lo != hi:
            value = rel[hi]["latency_s"]["median"] / rel[lo]["latency_s"]["median"]
            ratios["relay_time_most_over_one"] = {"nodes": [int(lo), int(hi)], "value": value,
                                                  "target": TARGET_TIME_RATIO, "met": value <= TARGET_TIME_RATIO}
            ratios["relay_nodes_hold_most_over_one"] = (rel[hi]["nodes_hold_s"]["median"]
                                                        / rel[lo]["nodes_hold_s"]["median"])
    if "relay" in results and "direct" in results:
        ratios["direct_over_relay_bytes"] = {n: results["direct"][n]["bytes_per_update"] / r["bytes_per_update"]
                                             for n, r in results["relay"].items()}
        ratios["direct_over_relay_time"] = {n: results["direct"][n]["latency_s"]["median"] / r["latency_s"]["median"]
                                            for n, r in results["relay"].items()}
        if "direct" in results and len(counts) > 1:
            d = results["direct"]
            ratios["direct_time_most_over_one"] = (d[str(max(counts))]["latency_s"]["median"]
                                                   / d[str(min(counts))]["latency_s"]["median"])
    report = {"benchmark": "weight_fanout", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "machine": machine(), "config": {**vars(args), "out": None}, "results": results, "ratios": ratios}
    print(json.dumps(ratios, indent=1))
    out = args.out or RESULTS_DIR / f"weight_fanout-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
