"""Where the asyncrl data plane spends its time: cProfile of all four busy threads of the real path.

Runs the ``asyncrl`` path of :mod:`benchmarks.data_plane` (same payload and loader config) with the workers
started by this script instead of the loader's launcher, so that each can be profiled:

    consumer main thread     ``for batch in loader``: pool.take, Batcher, collate
    consumer receiver thread ``ZmqRolloutReceiver._run``: recv, decode, Group.from_wire, pool, grants
    worker main thread       ``run_worker``: take_leases, fake engine, reward, validate, encode
    worker sender thread     ``ZmqRolloutSender._run``: leases in, groups out

cProfile is per thread, so each thread's ``_run`` (or main loop) is wrapped in its own profiler; the
workers dump theirs when the loader shuts them down. Prints, per thread, the functions with the most
own time as % of that thread's profiled time, and keeps the ``.prof`` files (``--out-dir``, default a
temp dir; open them with ``python -m pstats``). cProfile slows Python-heavy code, so read shares, not rates.

    .venv/bin/python -m benchmarks.profile_asyncrl [--workers 2] [--seconds 8] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import multiprocessing as mp
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import LoaderConfig, TransportConfig, WorkerConfig
from asyncrl.transport import zmq as zmq_transport
from benchmarks.data_plane import (
    ENGINE,
    GROUP_SIZE,
    Prompts,
    collate_counting,
    loader_batches,
    stop_processes,
)
from datapipes.loader import RolloutLoader


def profile_method(cls: type, name: str, out: Path) -> None:
    """Replaces ``cls.name`` by a wrapper that profiles the call (a thread's whole run) into ``out``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        prof = cProfile.Profile()
        try:
            return prof.runcall(original, self, *args, **kwargs)
        finally:
            prof.dump_stats(out)

    setattr(cls, name, wrapper)


def profiled_worker(endpoint: str, worker_id: str, out_dir: Path, experiment: dict[str, Any], profile: bool) -> None:
    """A real rollout worker (``run_worker``), its main and sender threads profiled if ``profile``."""
    from asyncrl import codec
    from workers.worker import run_worker

    torch.set_num_threads(1)  # as LocalWorkerLauncher's OMP_NUM_THREADS=1
    if experiment["switch_interval"] is not None:  # experiment: GIL hand-over latency between the worker's threads
        sys.setswitchinterval(experiment["switch_interval"])
    if experiment["inline_max_bytes"] is not None:  # experiment: tensors up to this size travel in the header frame
        codec.INLINE_MAX_BYTES = experiment["inline_max_bytes"]
    config = WorkerConfig(engine=ENGINE, slots=experiment["slots"] or WorkerConfig().slots)
    run = functools.partial(run_worker, [endpoint], config, TransportConfig(), worker_id=worker_id)
    if not profile:
        return run()
    profile_method(zmq_transport.ZmqRolloutSender, "_run", out_dir / f"{worker_id}-sender.prof")
    prof = cProfile.Profile()
    try:
        prof.runcall(run)
    finally:
        prof.dump_stats(out_dir / f"{worker_id}-main.prof")


def consume(loader: RolloutLoader, seconds: float, out: Path | None) -> int:
    """Runs (and profiles, with ``out``) the consumer loop for ``seconds`` after the first batch."""
    batches = loader_batches(loader)
    next(batches)
    prof, rollouts = cProfile.Profile(), 0
    if out is not None:
        prof.enable()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        rollouts += len(next(batches)["uids"])
    prof.disable()
    if out is not None:
        prof.dump_stats(out)
    how = "under cProfile" if out is not None else "unprofiled"
    print(f"consumed {rollouts} rollouts in {seconds} s {how} ({rollouts / seconds:,.0f}/s)")
    return rollouts


def report(path: Path, top: int) -> None:
    st = pstats.Stats(str(path))
    total = st.total_tt  # type: ignore[attr-defined]
    print(f"\n== {path.name}: {total:.2f} s profiled; own time (tottime) and cumulative, % of the thread ==")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    for (file, line, func), (_, calls, tt, ct, _) in rows:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        print(f"  {100 * tt / total:5.1f}% own {100 * ct / total:5.1f}% cum {calls:>9,} calls  {func}  ({where})")


def run(args: argparse.Namespace, out_dir: Path) -> None:
    """The asyncrl path with workers started here, so that every busy thread can be profiled."""
    profile = not args.no_profile
    if profile:
        profile_method(zmq_transport.ZmqRolloutReceiver, "_run", out_dir / "consumer-receiver.prof")
    config = LoaderConfig(group_size=GROUP_SIZE, max_staleness=None, capacity=64, num_workers=0, wait_timeout_s=120)
    loader = RolloutLoader(Prompts(args.prompts), config, collate_fn=collate_counting)
    ctx = mp.get_context("spawn")
    experiment = {k: getattr(args, k) for k in ("inline_max_bytes", "switch_interval", "slots")}
    worker_args = [(loader.endpoint, f"w{i}", out_dir, experiment, profile) for i in range(args.workers)]
    procs = [ctx.Process(target=profiled_worker, args=a) for a in worker_args]
    try:
        for proc in procs:
            proc.start()
        consume(loader, args.seconds, out_dir / "consumer-main.prof" if profile else None)
    finally:
        loader.close()  # SHUTDOWN to the workers: they return from run_worker and dump their profiles
        stop_processes(procs, ctx.Event())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--prompts", type=int, default=200_000)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--consumer-threads", type=int, default=1, help="torch intra-op threads here (0 = default)")
    p.add_argument("--inline-max-bytes", type=int, default=None, help="experiment: codec.INLINE_MAX_BYTES in workers")
    p.add_argument("--switch-interval", type=float, default=None, help="experiment: sys.setswitchinterval everywhere")
    p.add_argument("--slots", type=int, default=None, help="experiment: WorkerConfig.slots")
    p.add_argument("--no-profile", action="store_true", help="measure rollouts/s of this set-up without cProfile")
    p.add_argument("--out-dir", type=Path, default=None, help="where the .prof files go (default: a temp dir)")
    args = p.parse_args()
    if args.consumer_threads > 0:
        torch.set_num_threads(args.consumer_threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="asyncrl-profile-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    run(args, out_dir)
    if args.no_profile:
        return
    workers = [f"w{i}-{thread}" for i in range(args.workers) for thread in ("main", "sender")]
    for name in ["consumer-main", "consumer-receiver", *workers]:
        if (out_dir / f"{name}.prof").exists():
            report(out_dir / f"{name}.prof", args.top)
    print(f"\nprofiles in {out_dir} (python -m pstats FILE)")


if __name__ == "__main__":
    main()
