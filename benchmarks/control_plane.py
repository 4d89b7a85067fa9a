"""Control plane at scale: one pool fed by a swarm of simulated workers, this checkout against an older one.

The pool is a real trainer rank's pool and ZeroMQ receiver in its own process (``benchmarks/_control_plane_pool.py``),
with a trainer thread that takes groups, commits each batch and moves the policy version (a step that costs nothing).
The workers are :class:`asyncrl.testing.swarm.Swarm`: real DEALER sockets speaking the rollout protocol, hundreds in
one thread, each answering a lease with a valid group once its simulated engine call is done, heartbeating with a
status the size of a real worker's. With ``--baseline-ref`` the same phases run first against that commit (exported
with ``git archive``, imported through ``PYTHONPATH``): before and after in one JSON, on the same machine and load.

Phases, each in a fresh pool process:

  window   the default setting that starved workers: ``group_size=4``, ``batch_size=8``, ``max_staleness=1`` (a window
           of 16 groups), static workers with 8 slots and ``max_batch=4``, an engine that costs nothing; at each
           ``--workers``: groups per worker over the window (min / median / max, workers served), pool CPU-seconds per
           1k groups (the process, and its receiver thread), groups/s.
  paced    the pool's own cost and the lease-grant latency at a fixed offered load, whatever the number of workers:
           streaming workers with 2 slots each whose engine takes ``workers × 2 / --paced-rate`` seconds a lease (±50 %),
           no staleness bound; the credit round trip (a group sent to the next lease received, as the worker sees it:
           the group's decode and admission, the grant, the LEASES message) p50 / p99, and CPU per 1k groups.
  idle     the largest ``--workers`` connected and nothing to do (the trainer stops taking: the window fills and every
           lease comes back): the pool process's CPU as a share of one core; then one real worker process
           (``asyncrl worker``, fake engine, no weight sync) joins the idle pool: its CPU share (all its threads, from
           ``/proc/PID/task/*/schedstat``).
  scaling  rollouts/s against the number of workers with an engine that takes time (``--service-s`` a call, ±50 %),
           static workers with 8 slots and ``max_batch=4`` and a window of ``(1 + 1) × --scaling-batch-size``
           groups: rollouts/s grows with the workers until the window binds (at window / max_batch workers).

Targets (``targets`` in the JSON): CPU per 1k groups at the largest ``--workers`` ≤ 2× that at the smallest (window
and paced); the idle pool ≤ 5 % of a core; an idle worker ≤ 0.1 % of a core; every worker served in ``window``.

    .venv/bin/python -m benchmarks.control_plane [--workers 8,64,256] [--seconds 6] [--baseline-ref main]
        [--phases window,paced,idle,scaling] [--out benchmarks/results/control_plane-DATE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.testing.swarm import Swarm
from benchmarks._report import git_commit, machine

ROOT = Path(__file__).resolve().parent.parent
POOL_SCRIPT = Path(__file__).resolve().parent / "_control_plane_pool.py"
RESULTS = ROOT / "benchmarks" / "results"
GROUP_SIZE = 4
TARGETS = {"cpu_per_group_largest_over_smallest": 2.0, "idle_pool_core_share": 0.05, "idle_worker_core_share": 0.001}


# -- processes -------------------------------------------------------------------------------------------------------
class PoolProcess:
    """The pool process of one phase: JSON commands in, JSON answers out (see ``_control_plane_pool.py``)."""

    def __init__(self, tree: Path, **options: Any):
        argv = [sys.executable, str(POOL_SCRIPT)]
        for key, value in options.items():
            if value is not None:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = self._read()
        self.endpoint, self.module = hello["endpoint"], hello["asyncrl"]
        if not Path(self.module).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the pool process imported {self.module}, not the tree under test {tree}")

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the pool process exited ({self.proc.wait()})")
        return json.loads(line)

    def cmd(self, **command: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write('{"cmd": "quit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def pool_and_swarm(tree: Path, workers: int, swarm: dict[str, Any], **pool: Any) -> Iterator[tuple[PoolProcess, Swarm]]:
    p = PoolProcess(tree, max_peers=workers + 4, **pool)
    s = None
    try:
        s = Swarm(p.endpoint, workers, group_size=GROUP_SIZE, **swarm).start(timeout=120)
        yield p, s
    finally:
        if s is not None:
            s.close()
        p.close()


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of ``pid`` (nanoseconds from ``/proc/PID/task/*/schedstat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def export_tree(ref: str, into: Path) -> str:
    """The packages of ``ref`` (a commit, branch or tag of this repository) under ``into``; returns its commit."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "asyncrl", "datapipes", "workers"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return commit


# -- measuring -------------------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def spread(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    got = sorted(after[w] - before.get(w, 0) for w in after)
    return {"min": got[0], "median": statistics.median(got), "max": got[-1], "served": sum(g > 0 for g in got),
            "workers": len(got)}


def window_of(p: PoolProcess, s: Swarm, seconds: float, warmup_s: float) -> dict[str, Any]:
    """Starts the trainer, lets it warm up, then measures one window of ``seconds``."""
    p.cmd(cmd="consume", on=True)
    time.sleep(warmup_s)
    s.take_waits()
    g0, a0, c0 = s.groups(), p.cmd(cmd="snapshot"), s.cpu_s()
    time.sleep(seconds)
    g1, a1, c1 = s.groups(), p.cmd(cmd="snapshot"), s.cpu_s()
    waits = s.take_waits()
    wall, groups = a1["t"] - a0["t"], a1["groups"] - a0["groups"]
    per_1k = (lambda key: None if not groups or a0[key] is None or a1[key] is None
              else round((a1[key] - a0[key]) / groups * 1000, 4))
    return {
        "groups": groups, "wall_s": round(wall, 3), "groups_per_s": round(groups / wall, 1),
        "rollouts_per_s": round(groups * GROUP_SIZE / wall, 1),
        "pool_cpu_s_per_1k_groups": per_1k("process_cpu_s"), "receiver_cpu_s_per_1k_groups": per_1k("receiver_cpu_s"),
        "pool_core_share": round((a1["process_cpu_s"] - a0["process_cpu_s"]) / wall, 4),
        "swarm_core_share": None if c0 is None or c1 is None else round((c1 - c0) / wall, 4),
        "groups_per_worker": spread(g0, g1),
        "credit_wait_ms": {"p50": _ms(pct(waits, 0.5)), "p99": _ms(pct(waits, 0.99)), "n": len(waits)},
        "load_avg": os.getloadavg()[0],
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def phase_window(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for n in args.workers:
        swarm = {"slots": 8, "max_batch": 4, "heartbeat_s": args.heartbeat_s}
        with pool_and_swarm(tree, n, swarm, max_staleness=1, batch_size=8, heartbeat_s=args.heartbeat_s) as (p, s):
            out[str(n)] = window_of(p, s, args.seconds, args.warmup_s)
        print(f"  window  {n:4d} workers: {_line(out[str(n)])}", flush=True)
    return out


def phase_paced(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for n in args.workers:
        service_s = n * 2 / args.paced_rate
        swarm = {"slots": 2, "streaming": True, "service_s": service_s, "jitter": 0.5, "heartbeat_s": args.heartbeat_s}
        with pool_and_swarm(tree, n, swarm, heartbeat_s=args.heartbeat_s) as (p, s):
            out[str(n)] = {"service_s": service_s,
                           **window_of(p, s, max(args.seconds, 2 * service_s), args.warmup_s + 1.5 * service_s)}
        print(f"  paced   {n:4d} workers: {_line(out[str(n)])}", flush=True)
    return out


def phase_idle(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = max(args.workers)
    swarm = {"slots": 8, "max_batch": 4, "heartbeat_s": args.heartbeat_s}
    with pool_and_swarm(tree, n, swarm, max_staleness=1, batch_size=8, heartbeat_s=args.heartbeat_s) as (p, _):
        p.cmd(cmd="consume", on=True)
        time.sleep(1.0)
        p.cmd(cmd="consume", on=False)
        deadline = time.monotonic() + 30
        while p.cmd(cmd="snapshot")["leased"] and time.monotonic() < deadline:  # every lease comes back
            time.sleep(0.2)
        time.sleep(1.0)
        a0 = p.cmd(cmd="snapshot")
        time.sleep(args.idle_seconds)
        a1 = p.cmd(cmd="snapshot")
        wall = a1["t"] - a0["t"]
        out: dict[str, Any] = {
            "workers": n, "wall_s": round(wall, 3), "leased": a1["leased"], "buffered": a1["buffered"],
            "pool_core_share": round((a1["process_cpu_s"] - a0["process_cpu_s"]) / wall, 5),
            "receiver_core_share": None if a0["receiver_cpu_s"] is None else round(
                (a1["receiver_cpu_s"] - a0["receiver_cpu_s"]) / wall, 5),
            "messages_per_s": round((a1["counters"]["messages"] - a0["counters"]["messages"]) / wall, 1),
            "leases_granted": a1["counters"]["leases_granted"] - a0["counters"]["leases_granted"],
        }
        print(f"  idle    {n:4d} workers: pool {out['pool_core_share']:.2%} of a core, "
              f"{out['messages_per_s']:.0f} messages/s", flush=True)
        out["worker"] = idle_worker(tree, p, n, args)
        print(f"  idle    one real worker: {out['worker']['core_share']:.3%} of a core", flush=True)
    return out


def idle_worker(tree: Path, p: PoolProcess, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """A real worker process joins the idle pool; its CPU share once it is settled."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "asyncrl.cli", "worker", "--connect", p.endpoint, "--worker-id", "idle-worker",
            "--set", f"transport.heartbeat_s={args.heartbeat_s}"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while p.cmd(cmd="snapshot")["workers"] <= n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the idle worker did not join: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.2)
        time.sleep(2.0)  # start-up done
        c0, t0 = process_cpu_s(proc.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        c1, t1 = process_cpu_s(proc.pid), time.monotonic()
        threads = len(list(Path(f"/proc/{proc.pid}/task").iterdir()))
        return {"core_share": round((c1 - c0) / (t1 - t0), 6), "cpu_s": round(c1 - c0, 6), "wall_s": round(t1 - t0, 3),
                "threads": threads}
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def phase_scaling(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for n in args.scaling_workers:
        swarm = {"slots": 8, "max_batch": 4, "service_s": args.service_s, "jitter": 0.5,
                 "heartbeat_s": args.heartbeat_s}
        with pool_and_swarm(tree, n, swarm, max_staleness=1, batch_size=args.scaling_batch_size,
                            heartbeat_s=args.heartbeat_s) as (p, s):
            out[str(n)] = window_of(p, s, args.seconds, args.warmup_s + args.service_s)
        print(f"  scaling {n:4d} workers: {_line(out[str(n)])}", flush=True)
    return out


def _line(m: dict[str, Any]) -> str:
    g = m["groups_per_worker"]
    return (f"{m['rollouts_per_s']:8.0f} rollouts/s, pool {m['pool_cpu_s_per_1k_groups']} CPU-s/1k groups, "
            f"groups/worker {g['min']}/{g['median']}/{g['max']} ({g['served']}/{g['workers']} served), "
            f"credit wait p50 {m['credit_wait_ms']['p50']} ms p99 {m['credit_wait_ms']['p99']} ms")


PHASES = {"window": phase_window, "paced": phase_paced, "idle": phase_idle, "scaling": phase_scaling}


def verdict(r: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The targets, on one tree's results."""
    small, large = str(min(args.workers)), str(max(args.workers))
    out: dict[str, Any] = {}
    for phase in ("window", "paced"):
        if phase in r and r[phase][small]["pool_cpu_s_per_1k_groups"]:
            ratio = r[phase][large]["pool_cpu_s_per_1k_groups"] / r[phase][small]["pool_cpu_s_per_1k_groups"]
            out[f"{phase}_cpu_per_group_{large}_over_{small}"] = {
                "value": round(ratio, 3), "target": TARGETS["cpu_per_group_largest_over_smallest"],
                "met": ratio <= TARGETS["cpu_per_group_largest_over_smallest"]}
    if "window" in r:
        out["window_every_worker_served"] = {"met": all(m["groups_per_worker"]["min"] > 0 for m in r["window"].values())}
    if "idle" in r:
        share = r["idle"]["pool_core_share"]
        out["idle_pool_core_share"] = {"value": share, "target": TARGETS["idle_pool_core_share"],
                                       "met": share <= TARGETS["idle_pool_core_share"]}
        share = r["idle"]["worker"]["core_share"]
        out["idle_worker_core_share"] = {"value": share, "target": TARGETS["idle_worker_core_share"],
                                         "met": share <= TARGETS["idle_worker_core_share"]}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--workers", type=ints, default=[8, 64, 256])
    p.add_argument("--scaling-workers", type=ints, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--seconds", type=float, default=6.0, help="each measured window")
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--paced-rate", type=float, default=100.0, help="groups/s the paced swarm offers")
    p.add_argument("--service-s", type=float, default=0.4, help="scaling: seconds of one engine call")
    p.add_argument("--scaling-batch-size", type=int, default=32)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--baseline-ref", default=None, help="a commit to measure first, as the baseline (e.g. main)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    result: dict[str, Any] = {
        "benchmark": "control_plane", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "machine": machine(), "load_avg_start": os.getloadavg(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {
            "group_size": GROUP_SIZE, "window": {"max_staleness": 1, "batch_size": 8, "slots": 8, "max_batch": 4}},
        "targets": TARGETS, "trees": {},
    }
    with tempfile.TemporaryDirectory(prefix="asyncrl-control-plane-") as tmp:
        trees = []
        if args.baseline_ref:
            base = Path(tmp) / "baseline"
            base.mkdir()
            trees.append(("baseline", base, export_tree(args.baseline_ref, base)))
        trees.append(("current", ROOT, git_commit()))
        for name, tree, commit in trees:
            print(f"{name} ({commit})", flush=True)
            r: dict[str, Any] = {"ref": args.baseline_ref if name == "baseline" else "HEAD", "commit": commit}
            for phase in phases:
                r[phase] = PHASES[phase](tree, args)
            r["verdict"] = verdict(r, args)
            result["trees"][name] = r
    if "baseline" in result["trees"]:
        result["ratios"] = ratios(result["trees"]["baseline"], result["trees"]["current"])
    result["load_avg_end"] = os.getloadavg()
    out = args.out or RESULTS / f"control_plane-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return result


def ratios(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """current ÷ baseline, measured in this run."""
    out: dict[str, Any] = {}
    for phase in ("window", "paced", "scaling"):
        for n, m in after.get(phase, {}).items():
            b = before.get(phase, {}).get(n)
            if not b:
                continue
            entry = {}
            if b["rollouts_per_s"]:
                entry["rollouts_per_s"] = round(m["rollouts_per_s"] / b["rollouts_per_s"], 3)
            if b["pool_cpu_s_per_1k_groups"] and m["pool_cpu_s_per_1k_groups"]:
                entry["pool_cpu_per_group"] = round(m["pool_cpu_s_per_1k_groups"] / b["pool_cpu_s_per_1k_groups"], 3)
            if b["credit_wait_ms"]["p50"] and m["credit_wait_ms"]["p50"]:
                entry["credit_wait_p50"] = round(m["credit_wait_ms"]["p50"] / b["credit_wait_ms"]["p50"], 3)
            out[f"{phase}/{n}"] = entry
    if "idle" in before and "idle" in after:
        out["idle/pool_core_share"] = round(after["idle"]["pool_core_share"] / max(before["idle"]["pool_core_share"],
                                                                                      1e-9), 3)
        out["idle/worker_core_share"] = round(after["idle"]["worker"]["core_share"]
                                              / max(before["idle"]["worker"]["core_share"], 1e-9), 3)
    return out


if __name__ == "__main__":
    main()
