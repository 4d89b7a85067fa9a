"""Data-plane throughput: rollouts/s and MB/s delivered to one consumer, asyncrl against baselines.

Payload: 1k-token rollouts (64 prompt tokens, exactly 1024 response tokens from the fake engine with
``min_new_tokens = max_new_tokens = 1024`` and no simulated decode time) in groups of 4, produced by N
processes (``--workers``, default 2). Bytes are the payload: ``nbytes`` of prompt_ids + response_ids +
logprobs per rollout (8448 B); 1 MB = 1e6 B. Paths, all measured in this one run:

  asyncrl           ``RolloutLoader(num_workers=N)``, the full path: worker processes (fake engine +
                    fake_reward), ZeroMQ ROUTER/DEALER with leases and credits, codec decode +
                    ``Group.from_wire`` validation, pool (ledger, dedup, versions), torchdata Batcher +
                    ``collate_groups``. The consumer is a ``for batch in loader`` loop.
  asyncrl_slots16   the same with 16 credits per worker instead of ``WorkerConfig.slots`` (4 = max_batch, so
                    a worker idles for a lease round trip after each batch): what a default change would give.
  mp_queue          the baseline: N spawn processes run the same worker step (``RolloutWorker.step``:
                    fake engine, fake_reward, ``Rollout.validate``) and put each ``Group`` on a
                    ``multiprocessing.Queue(maxsize=capacity)``; torch's ForkingPickler reductions move
                    the tensors through shared memory, as in a DataLoader. The consumer gets
                    ``batch_size`` groups and calls ``collate_groups``: the same consumer work as asyncrl.
  mp_queue_bytes    the same, but each group is put as plain ``pickle.dumps(group, protocol=5)`` bytes.
  mp_queue_numpy    the strongest Queue variant: ``to_wire()`` dicts with numpy arrays (pickled as raw
                    bytes); the consumer validates with ``Group.from_wire`` (as asyncrl's receiver) and collates.
  zmq_raw           the transport's limit: N processes pre-encode ONE group with ``asyncrl.codec.encode``
                    and send its frames in a loop (PUSH, ``copy=False``) to a PULL on tcp://127.0.0.1:0;
                    the consumer receives and decodes (no validation, ledger or collate).
  zmq_raw_nodecode  the same without decode.
  zmq_same_work     asyncrl's work at both ends without its control plane: producers run the real worker
                    step and encode each group, PUSH to PULL; the consumer decodes, ``Group.from_wire``
                    validates and ``collate_groups`` batches (no leases, ledger, pool, threads or torchdata).
  ray_actor         the design of verl's fully-async trainer (``verl/experimental/fully_async_policy/
                    message_queue.py``): one Ray actor holds a bounded deque (asyncio actor, ``maxsize =
                    capacity``); N producer actors run the same worker step as mp_queue and call
                    ``ray.get(queue.put.remote(group))`` (waiting while the queue is full: backpressure, where
                    verl drops the oldest sample); the consumer calls ``ray.get(queue.get.remote())``
                    ``batch_size`` times (waiting while it is empty) and ``collate_groups``. Ray serializes the
                    ``Group`` (pickle 5, out-of-band buffers; the object store for values over 100 KiB).
  ray_actor_bytes   the same, putting ``pickle.dumps(group, protocol=5)`` bytes: what verl actually puts
                    (``ray.cloudpickle.dumps(sample)``); the consumer unpickles and collates.
  ray_actor_numpy   the same, putting ``to_wire()`` dicts with numpy arrays (out-of-band buffers in Ray's
                    serializer); the consumer validates with ``Group.from_wire`` and collates.
                    Ray is optional (``pip install .[bench]``): without it the ray paths are skipped and
                    recorded as ``{"skipped": reason}``. Each ray path starts and shuts down its own local
                    Ray instance (``address="local"``), outside the clock; run from the repository root
                    (Ray workers import this module from the driver's working directory).

Each path starts its producers, waits for the first delivery (start-up stays outside the clock) and then
measures ``--repeats`` back-to-back windows of ``--seconds``. The JSON in ``benchmarks/results/`` has
config, machine, commit, date, median/min/max per path, the CPU time each role spent per rollout
during the windows (for the ray paths also the queue actor's and Ray's node processes', ``other:*``), the
1-minute load average, and the ratios asyncrl/<path> (targets: >= 2x mp_queue, >= 0.75x zmq_raw, >= 5x
ray_actor). The consumer process runs with ``--consumer-threads`` torch threads (default 1, as the
workers): on a small machine intra-op threads spin and steal the producers' cores.

    .venv/bin/python -m benchmarks.data_plane [--workers 2] [--seconds 8] [--repeats 3] [--paths asyncrl,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import signal
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import zmq
from tqdm import tqdm

from asyncrl.codec import decode, encode
from asyncrl.config import FakeEngineConfig, LoaderConfig, WorkerConfig
from asyncrl.rewards.legacy import fake_reward
from asyncrl.rollout import Group
from asyncrl.transport import ReceivedLease, RolloutSender
from benchmarks._report import machine
from datapipes.collate import TrainBatch, collate_groups
from datapipes.loader import RolloutLoader
from workers.engines.fake import FakeEngine
from workers.worker import RolloutWorker

PROMPT_TOKENS = 64
RESPONSE_TOKENS = 1024
GROUP_SIZE = 4
VOCAB = 32000
MB = 1e6
PAYLOAD_BYTES_KEY = "payload_bytes"
TENSOR_FIELDS = ("prompt_ids", "response_ids", "logprobs")  # the payload counted in bytes/s
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ENGINE = FakeEngineConfig(min_new_tokens=RESPONSE_TOKENS, max_new_tokens=RESPONSE_TOKENS, seconds_per_token=0.0)
TARGETS = {"asyncrl/mp_queue": 2.0, "asyncrl/zmq_raw": 0.75, "asyncrl/ray_actor": 5.0}
Step = Callable[[], tuple[int, int]]  # consumes one delivery -> (rollouts, payload bytes)


# -- payload -------------------------------------------------------------------------------------
def make_prompt(index: int) -> dict[str, list[int]]:
    return {"prompt_ids": [(index * 7919 + k) % VOCAB for k in range(PROMPT_TOKENS)]}


class Prompts(Sequence):
    """A lazy dataset of ``n`` prompts of ``PROMPT_TOKENS`` ids (large ``n`` costs no memory)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, list[int]]:  # type: ignore[override]
        if not 0 <= index < self.n:
            raise IndexError(index)
        return make_prompt(index)


def payload_bytes(group: Group) -> int:
    return sum(getattr(r, k).nbytes for r in group.rollouts for k in TENSOR_FIELDS)


def collate_counting(groups: list[Group]) -> TrainBatch:
    """``collate_groups`` plus the payload bytes delivered: the consumer work of every collating path."""
    batch = collate_groups(groups)
    batch[PAYLOAD_BYTES_KEY] = sum(payload_bytes(g) for g in groups)
    return batch


class CallbackSender(RolloutSender):
    """A sender that hands each finished group to ``deliver``: runs the real worker step off ZeroMQ."""

    def __init__(self, deliver: Callable[[Group], None]):
        self.deliver = deliver

    def start(self) -> None:
        pass

    def take_leases(self, max_leases: int, timeout: float) -> list[ReceivedLease]:
        return []

    def send_group(self, lease: ReceivedLease, group: Group) -> None:
        self.deliver(group)

    def send_failed(self, lease: ReceivedLease, error: str, culprit: str | None = None) -> None:
        raise RuntimeError(f"lease {lease.lease_id} failed ({culprit}): {error}")

    @property
    def done(self) -> bool:
        return False

    def set_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_worker(worker_id: str, deliver: Callable[[Group], None]) -> RolloutWorker:
    engine = FakeEngine(ENGINE)
    return RolloutWorker(worker_id, engine, fake_reward, CallbackSender(deliver), max_batch=WorkerConfig().max_batch)


def make_lease(prompt_index: int) -> ReceivedLease:
    return ReceivedLease(
        conn=0,
        lease_id=prompt_index + 1,
        epoch=0,
        prompt_index=prompt_index,
        group_size=GROUP_SIZE,
        prompt=make_prompt(prompt_index),
        policy_version=0,
    )


def lease_batches(rank: int, world: int, max_batch: int, num_prompts: int) -> Iterator[list[ReceivedLease]]:
    """Endless batches of leases for prompts ``rank, rank + world, ...``: the ledger's job in asyncrl."""
    k = rank
    while True:
        batch = []
        for _ in range(max_batch):
            batch.append(make_lease(k % num_prompts))
            k += world
        yield batch


def build_group(prompt_index: int) -> Group:
    """One group exactly as a worker builds it."""
    out: list[Group] = []
    make_worker("ref", out.append).step([make_lease(prompt_index)])
    return out[0]


# -- producers (spawned processes) ---------------------------------------------------------------
def to_queue_item(group: Group, mode: str) -> Any:
    """What an mp.Queue producer puts: the Group, its pickle, or its ``to_wire()`` dict with numpy arrays."""
    if mode == "objects":
        return group
    if mode == "bytes":
        return pickle.dumps(group, protocol=5)
    wire = group.to_wire()
    for r in wire["rollouts"]:
        r.update({k: r[k].numpy() for k in TENSOR_FIELDS})
    return wire


def from_queue_item(item: Any, mode: str) -> Group:
    if mode == "objects":
        return item
    if mode == "bytes":
        return pickle.loads(item)
    for r in item["rollouts"]:
        r.update({k: torch.from_numpy(r[k]) for k in TENSOR_FIELDS})
    return Group.from_wire(item, group_size=GROUP_SIZE)  # validated, as asyncrl's receiver does


def mp_queue_producer(rank: int, world: int, num_prompts: int, mode: str, queue: Any, stop: Any) -> None:
    """Baseline producer: the real worker step, then ``Queue.put`` of each group."""
    torch.set_num_threads(1)  # as LocalWorkerLauncher's OMP_NUM_THREADS=1
    queue.cancel_join_thread()  # exit without flushing: the consumer stops reading at the end

    def deliver(group: Group) -> None:
        item = to_queue_item(group, mode)
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.2)
                return
            except queue_lib.Full:
                continue

    worker = make_worker(f"mpq-{rank}", deliver)
    for leases in lease_batches(rank, world, worker.max_batch, num_prompts):
        if stop.is_set():
            return
        worker.step(leases)


def zmq_producer(rank: int, world: int, num_prompts: int, endpoint: str, stop: Any, generate: bool) -> None:
    """ZeroMQ PUSH producer.

    ``generate=False``: one group encoded once, its frames sent in a loop (the transport's limit).
    ``generate=True``: the real worker step, each group encoded and sent (asyncrl's producer work, no leases).
    """
    torch.set_num_threads(1)  # as LocalWorkerLauncher's OMP_NUM_THREADS=1
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 200)  # a blocked send re-checks the stop event
    sock.connect(endpoint)
    try:
        if generate:
            worker = make_worker(f"zmq-{rank}", lambda g: send_until_stopped(sock, encode("group", g.to_wire()), stop))
            for leases in lease_batches(rank, world, worker.max_batch, num_prompts):
                if stop.is_set():
                    return
                worker.step(leases)
        frames = encode("group", build_group(rank).to_wire())
        while not stop.is_set():
            for _ in range(64):
                try:
                    sock.send_multipart(frames, copy=False)
                except zmq.Again:
                    break
    finally:
        sock.close(linger=0)
        ctx.term()


def send_until_stopped(sock: zmq.Socket, frames: list, stop: Any) -> None:
    while not stop.is_set():
        try:
            sock.send_multipart(frames, copy=False)
            return
        except zmq.Again:
            continue


# -- the Ray actor queue (verl's fully-async MessageQueue) -----------------------------------------
class PathSkipped(Exception):
    """A path that cannot run here (an optional dependency is missing): recorded as skipped, not a crash."""


class RayQueue:
    """verl's ``MessageQueue`` with backpressure: an asyncio Ray actor holding a deque of at most ``maxsize`` items.

    ``put`` waits while the queue is full (verl's ``put_sample`` drops the oldest sample instead; this
    benchmark counts every delivered rollout, so it waits as ``mp.Queue.put`` does); ``get`` waits while it
    is empty, as verl's ``get_sample``. ``close`` wakes everyone: ``put`` then returns False, ``get`` None.
    Plain class here; ``ray.remote`` wraps it in :func:`ray_actor_queue` so that importing this module needs
    no Ray.
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque[Any] = deque()
        self.running = True
        self.produced = self.consumed = 0
        lock = asyncio.Lock()  # no event loop needed at construction (Python >= 3.10), as in verl
        self.not_empty, self.not_full = asyncio.Condition(lock), asyncio.Condition(lock)

    async def put(self, item: Any) -> bool:
        async with self.not_full:
            while self.running and len(self.items) >= self.maxsize:
                await self.not_full.wait()
            if not self.running:
                return False
            self.items.append(item)
            self.produced += 1
            self.not_empty.notify()
            return True

    async def get(self) -> Any:
        async with self.not_empty:
            while self.running and not self.items:
                await self.not_empty.wait()
            if not self.items:
                return None
            self.consumed += 1
            self.not_full.notify()
            return self.items.popleft()

    async def close(self) -> None:
        async with self.not_empty:
            self.running = False
            self.not_empty.notify_all()
            self.not_full.notify_all()

    async def stats(self) -> dict[str, int]:
        return {"size": len(self.items), "produced": self.produced, "consumed": self.consumed}

    def pid(self) -> int:
        return os.getpid()


class RayProducer:
    """A producer actor: the real worker step (as :func:`mp_queue_producer`), then ``queue.put`` of each group."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # as LocalWorkerLauncher's OMP_NUM_THREADS=1

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, world: int, num_prompts: int, mode: str, queue: Any) -> int:
        """Produces until the queue is closed; returns the groups put. One put in flight, as verl's rollouter."""
        import ray

        closed, groups = False, 0

        def deliver(group: Group) -> None:
            nonlocal closed, groups
            if not closed and ray.get(queue.put.remote(to_queue_item(group, mode))):
                groups += 1
            else:
                closed = True

        worker = make_worker(f"ray-{rank}", deliver)
        for leases in lease_batches(rank, world, worker.max_batch, num_prompts):
            if closed:
                return groups
            worker.step(leases)
        return groups


def importable_self() -> Any:
    """This module under its import name: under ``-m`` it is ``__main__``, whose classes Ray would pickle by value."""
    return importlib.import_module("benchmarks.data_plane") if __name__ == "__main__" else sys.modules[__name__]


def ray_node_pids(ray: Any) -> dict[str, list[int]]:
    """pids of the local Ray node's own processes (GCS, raylet, agents, ...) by type; {} if Ray hides them."""
    try:
        node = ray._private.worker._global_node  # internal API: only for CPU accounting and the exit check
        return {kind: [info.process.pid for info in infos if info.process is not None]
                for kind, infos in node.all_processes.items()}
    except Exception:
        return {}


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_alive(p)]
    return alive


@contextlib.contextmanager
def ray_actor_queue(args: argparse.Namespace, mode: str) -> Iterator[tuple[Callable[[], TrainBatch], dict[str, Any]]]:
    """A local Ray instance with one :class:`RayQueue` actor and ``args.workers`` :class:`RayProducer` actors.

    Yields ``next_batch`` (``batch_size`` × ``ray.get(queue.get.remote())``, then ``collate_counting``) and
    ``info`` (``producer_pids``; ``other_pids``: the queue actor and Ray's node processes, for CPU accounting;
    after exit ``leftover_pids``: Ray processes still alive after ``ray.shutdown()``, killed by pid).
    Raises :class:`PathSkipped` if Ray is not importable.
    """
    try:
        import ray
    except ImportError as e:
        raise PathSkipped(f"ray is not importable ({e}); pip install '.[bench]'") from e
    if ray.is_initialized():
        raise RuntimeError("a Ray instance is already initialized in this process; the ray paths start their own")
    mod = importable_self()
    info: dict[str, Any] = {"producer_pids": [], "other_pids": {}, "leftover_pids": []}
    watched: list[int] = []
    ray.init(address="local", num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True, configure_logging=False)
    try:
        queue_cls = ray.remote(num_cpus=2, max_concurrency=20)(mod.RayQueue)  # verl's resources for MessageQueue
        producer_cls = ray.remote(num_cpus=1)(mod.RayProducer)
        queue = queue_cls.remote(args.capacity)
        producers = [producer_cls.remote() for _ in range(args.workers)]
        info["producer_pids"] = ray.get([p.pid.remote() for p in producers], timeout=120)
        node_pids = ray_node_pids(ray)
        info["other_pids"] = {"queue_actor": [ray.get(queue.pid.remote(), timeout=120)],
                              **{f"ray_{kind}": pids for kind, pids in node_pids.items()}}
        watched = [pid for pids in info["other_pids"].values() for pid in pids] + info["producer_pids"]
        runs = [p.run.remote(rank, args.workers, args.prompts, mode, queue) for rank, p in enumerate(producers)]

        def get_one() -> Any:
            """The next queued item: one ``ray.get`` as before, so the baseline measures what it did. While it waits
            (each second), a producer's run that raised raises here, instead of the consumer blocking on a queue
            nobody fills; with every producer done and nothing queued it gives up."""
            pending, deadline = queue.get.remote(), time.monotonic() + 120
            while True:
                try:
                    return ray.get(pending, timeout=1.0)
                except ray.exceptions.GetTimeoutError:
                    done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                    for ref in done:
                        ray.get(ref)  # raises the producer's error
                    if len(done) == len(runs) or time.monotonic() > deadline:
                        raise TimeoutError(f"the Ray queue delivered nothing ({len(done)} of {len(runs)} producers "
                                           "done)") from None

        def next_batch() -> TrainBatch:
            items = [get_one() for _ in range(args.batch_size)]
            if any(x is None for x in items):
                raise RuntimeError("the Ray queue closed under the consumer")
            return collate_counting([from_queue_item(x, mode) for x in items])

        with warnings.catch_warnings():  # Ray hands numpy arrays out read-only; collate copies them anyway
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            yield next_batch, info
        ray.get(queue.close.remote(), timeout=30)  # producers' next put returns False and run() returns
        ready, _ = ray.wait(runs, num_returns=len(runs), timeout=30)
        info["groups_put"] = sum(ray.get(ready)) if len(ready) == len(runs) else None
    finally:
        ray.shutdown()  # stops the actors, the raylet and the GCS this ray.init started
        leftover = wait_gone(watched, timeout=15)
        for pid in leftover:  # only pids this path's Ray instance started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        info["leftover_pids"] = leftover
        if leftover:
            print(f"warning: Ray processes {leftover} outlived ray.shutdown(); killed", file=sys.stderr)


def run_ray_actor(args: argparse.Namespace, *, mode: str) -> dict[str, Any]:
    with ray_actor_queue(args, mode) as (next_batch, info):

        def step() -> tuple[int, int]:
            batch = next_batch()
            return len(batch["uids"]), batch[PAYLOAD_BYTES_KEY]

        step()  # warm-up: actor start-up and the first batch stay outside the clock
        result = measure(step, args, RAY_PATHS[mode], info["producer_pids"], other_pids=info["other_pids"])
    result["ray"] = {k: info.get(k) for k in ("groups_put", "leftover_pids")}
    return result


def stop_processes(procs: list[Any], stop: Any, timeout: float = 10.0) -> None:
    """Ends the processes this benchmark started: stop event and join, then terminate/kill by pid."""
    stop.set()
    deadline = time.monotonic() + timeout
    started = [p for p in procs if p.pid is not None]
    for p in started:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in started:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


# -- measurement ---------------------------------------------------------------------------------
def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """user + system CPU seconds of a process (or one of its threads), from /proc; None elsewhere."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(
    producer_pids: list[int], other_pids: Mapping[str, list[int]] | None = None
) -> dict[str, float | None]:
    """CPU seconds so far: all producers, this process, each of its threads by name, and ``other:<name>``
    for each group of other processes (a queue actor, Ray's node processes)."""
    me = os.getpid()
    producers = [cpu_seconds(pid) for pid in producer_pids]
    out: dict[str, float | None] = {
        "producers": None if None in producers else sum(producers),  # type: ignore[arg-type]
        "consumer_process": cpu_seconds(me),
    }
    for name, pids in (other_pids or {}).items():
        values = [cpu_seconds(pid) for pid in pids]
        out[f"other:{name}"] = None if None in values else sum(values)  # type: ignore[arg-type]
    names = {t.native_id: t.name for t in threading.enumerate()}
    tids = sorted(int(t) for t in os.listdir(f"/proc/{me}/task")) if os.path.isdir(f"/proc/{me}/task") else []
    for tid in tids:
        key = f"consumer_thread:{names.get(tid, 'native (libzmq I/O, OpenMP, ...)')}"
        out[key] = (out.get(key) or 0.0) + (cpu_seconds(me, tid) or 0.0)
    return out


def measure(step: Step, args: argparse.Namespace, name: str, producer_pids: list[int],
            other_pids: Mapping[str, list[int]] | None = None) -> dict[str, Any]:
    """``--repeats`` back-to-back windows of ``--seconds``; ``step`` consumes one delivery."""
    windows, total_rollouts = [], 0
    load_before = os.getloadavg()[0]  # other load on the machine shows up here
    cpu0 = cpu_snapshot(producer_pids, other_pids)
    bar = tqdm(total=args.repeats * args.seconds, desc=f"{name:>16}", leave=False, bar_format="{l_bar}{bar}| {postfix}")
    for _ in range(args.repeats):
        rollouts = nbytes = 0
        t0 = now = time.perf_counter()
        next_tick = t0 + 0.5
        while now - t0 < args.seconds:
            r, b = step()
            rollouts, nbytes, now = rollouts + r, nbytes + b, time.perf_counter()
            if now >= next_tick:
                next_tick = now + 0.5
                bar.n = round(len(windows) * args.seconds + min(now - t0, args.seconds), 1)
                bar.set_postfix_str(f"{rollouts / (now - t0):,.0f} rollouts/s")
        elapsed = now - t0
        windows.append({"seconds": elapsed, "rollouts": rollouts, "bytes": nbytes,
                        "rollouts_per_s": rollouts / elapsed, "mb_per_s": nbytes / elapsed / MB})
        total_rollouts += rollouts
    bar.close()
    cpu1 = cpu_snapshot(producer_pids, other_pids)
    cpu = {k: None if v is None or cpu1.get(k) is None else cpu1[k] - v for k, v in cpu0.items()}  # type: ignore
    result = summarize(windows, cpu, total_rollouts)
    result["loadavg_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    return result


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(windows: list[dict[str, Any]], cpu: dict[str, float | None], total_rollouts: int) -> dict[str, Any]:
    per_rollout = {k: None if v is None else v / max(total_rollouts, 1) * 1e6 for k, v in cpu.items()}
    return {
        "rollouts_per_s": stats([w["rollouts_per_s"] for w in windows]),
        "mb_per_s": stats([w["mb_per_s"] for w in windows]),
        "cpu_s": cpu,
        "cpu_us_per_rollout": per_rollout,
        "windows": windows,
    }


# -- the paths -----------------------------------------------------------------------------------
def loader_batches(loader: RolloutLoader) -> Iterator[TrainBatch]:
    """Batches across epoch ends (each ``for`` over the loader starts the next epoch)."""
    while True:
        yield from loader


def run_asyncrl(args: argparse.Namespace, *, slots: int | None = None) -> dict[str, Any]:
    slots = args.slots if slots is None else slots
    config = LoaderConfig(
        group_size=GROUP_SIZE,
        batch_size=args.batch_size,
        max_staleness=None,
        capacity=args.capacity,
        num_workers=args.workers,
        wait_timeout_s=120,
        worker=WorkerConfig(engine=ENGINE, slots=slots, max_batch=args.max_batch),
    )
    loader = RolloutLoader(Prompts(args.prompts), config, collate_fn=collate_counting)
    try:
        batches = loader_batches(loader)

        def step() -> tuple[int, int]:
            batch = next(batches)
            return len(batch["uids"]), batch[PAYLOAD_BYTES_KEY]

        step()  # warm-up: worker start-up and the first batch stay outside the clock
        assert loader.launcher is not None
        name = "asyncrl" if slots == args.slots else f"asyncrl_slots{slots}"
        result = measure(step, args, name, [pid for pid in loader.launcher.pids if pid is not None])
        stats_ = loader.stats()
        result["loader_stats"] = {k: stats_[k] for k in ("epoch", "pool", "ledger", "peak")}
    finally:
        loader.close()
    return result


def run_mp_queue(args: argparse.Namespace, *, mode: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(maxsize=args.capacity), ctx.Event()
    procs = [
        ctx.Process(target=mp_queue_producer, args=(rank, args.workers, args.prompts, mode, queue, stop), daemon=True)
        for rank in range(args.workers)
    ]
    try:
        for p in procs:
            p.start()

        def step() -> tuple[int, int]:
            items = [queue.get(timeout=120) for _ in range(args.batch_size)]
            batch = collate_counting([from_queue_item(x, mode) for x in items])
            return len(batch["uids"]), batch[PAYLOAD_BYTES_KEY]

        step()
        return measure(step, args, MP_QUEUE_PATHS[mode], [p.pid for p in procs])
    finally:
        stop_processes(procs, stop)  # producers never block: put() has a timeout, no flush at exit
        queue.close()
        queue.join_thread()


def zmq_step(pull: zmq.Socket, mode: str, batch_size: int) -> Step:
    """The consumer's work per delivery: a group (``raw``, ``nodecode``) or a collated batch (``same_work``)."""
    ref_bytes = payload_bytes(build_group(0))  # every message carries one group of this size

    def nodecode() -> tuple[int, int]:
        pull.recv_multipart(copy=False)
        return GROUP_SIZE, ref_bytes

    def raw() -> tuple[int, int]:
        rollouts = decode(pull.recv_multipart(copy=False))[1]["rollouts"]
        return len(rollouts), sum(r[k].nbytes for r in rollouts for k in TENSOR_FIELDS)

    def same_work() -> tuple[int, int]:
        messages = [pull.recv_multipart(copy=False) for _ in range(batch_size)]
        batch = collate_counting([Group.from_wire(decode(m)[1], group_size=GROUP_SIZE) for m in messages])
        return len(batch["uids"]), batch[PAYLOAD_BYTES_KEY]

    return {"raw": raw, "nodecode": nodecode, "same_work": same_work}[mode]


def run_zmq(args: argparse.Namespace, *, mode: str) -> dict[str, Any]:
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 120_000)
    pull.bind("tcp://127.0.0.1:0")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    generate = mode == "same_work"
    procs = [
        ctx.Process(target=zmq_producer, args=(rank, args.workers, args.prompts, endpoint, stop, generate), daemon=True)
        for rank in range(args.workers)
    ]
    try:
        for p in procs:
            p.start()
        step = zmq_step(pull, mode, args.batch_size)
        step()
        return measure(step, args, ZMQ_PATHS[mode], [p.pid for p in procs])
    finally:
        stop_processes(procs, stop)
        pull.close(linger=0)
        zctx.term()


MP_QUEUE_PATHS = {"objects": "mp_queue", "bytes": "mp_queue_bytes", "numpy": "mp_queue_numpy"}
ZMQ_PATHS = {"raw": "zmq_raw", "nodecode": "zmq_raw_nodecode", "same_work": "zmq_same_work"}
RAY_PATHS = {"objects": "ray_actor", "bytes": "ray_actor_bytes", "numpy": "ray_actor_numpy"}
PATHS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "asyncrl": run_asyncrl,
    "asyncrl_slots16": partial(run_asyncrl, slots=16),
    **{name: partial(run_mp_queue, mode=mode) for mode, name in MP_QUEUE_PATHS.items()},
    **{name: partial(run_zmq, mode=mode) for mode, name in ZMQ_PATHS.items()},
    **{name: partial(run_ray_actor, mode=mode) for mode, name in RAY_PATHS.items()},
}


# -- report --------------------------------------------------------------------------------------
def ratios(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``asyncrl / baseline`` of median rollouts/s, with the targets where one is set (skipped paths left out)."""
    if "rollouts_per_s" not in metrics.get("asyncrl", {}):
        return {}
    ours = metrics["asyncrl"]["rollouts_per_s"]["median"]
    out = {}
    for name, m in metrics.items():
        if name != "asyncrl" and "rollouts_per_s" in m:
            key = f"asyncrl/{name}"
            value = ours / m["rollouts_per_s"]["median"]
            target = TARGETS.get(key)
            out[key] = {"value": value, "target": target, "met": None if target is None else value >= target}
    return out


def write_json(report: dict[str, Any], path: Path | None) -> Path:
    path = path or RESULTS_DIR / f"data_plane-{report['date'][:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'path':<18}{'rollouts/s median (min-max)':>32}{'MB/s median (min-max)':>28}")
    for name, m in report["metrics"].items():
        if "skipped" in m:
            print(f"{name:<18}{'skipped: ' + m['skipped']}")
            continue
        r, b = m["rollouts_per_s"], m["mb_per_s"]
        rate = f"{r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f})"
        mbs = f"{b['median']:,.1f} ({b['min']:,.1f}-{b['max']:,.1f})"
        print(f"{name:<18}{rate:>32}{mbs:>28}")
    for key, r in report["ratios"].items():
        target = "" if r["target"] is None else f"  target >= {r['target']}x: {'met' if r['met'] else 'MISSED'}"
        print(f"{key:<28}{r['value']:>6.2f}x{target}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="producer processes per path")
    p.add_argument("--seconds", type=float, default=8.0, help="length of one timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per path")
    p.add_argument("--batch-size", type=int, default=8, help="groups per collated batch")
    p.add_argument("--capacity", type=int, default=64, help="asyncrl pool capacity and mp.Queue maxsize")
    p.add_argument("--prompts", type=int, default=200_000, help="dataset size (large: no epoch end in a run)")
    p.add_argument("--slots", type=int, default=WorkerConfig().slots, help="asyncrl worker credits per pool")
    p.add_argument("--max-batch", type=int, default=WorkerConfig().max_batch, help="leases per engine call")
    p.add_argument("--consumer-threads", type=int, default=1,
                   help="torch intra-op threads of the consumer (0 = torch's default); producers use 1")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/data_plane-DATE.json)")
    args = p.parse_args(argv)
    args.paths = [s for s in args.paths.split(",") if s]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        p.error(f"unknown --paths {sorted(unknown)}; choose from {list(PATHS)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.consumer_threads > 0:
        torch.set_num_threads(args.consumer_threads)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(torch_threads_consumer=torch.get_num_threads(), prompt_tokens=PROMPT_TOKENS,
                  response_tokens=RESPONSE_TOKENS, group_size=GROUP_SIZE, mb=MB)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    metrics = {}
    for name in args.paths:
        try:
            metrics[name] = PATHS[name](args)
        except PathSkipped as e:
            metrics[name] = {"skipped": str(e)}
            print(f"{name:>16}: skipped: {e}", flush=True)
            continue
        m = metrics[name]["rollouts_per_s"]
        print(f"{name:>16}: {m['median']:,.0f} rollouts/s (min {m['min']:,.0f}, max {m['max']:,.0f})", flush=True)
    report = {"benchmark": "data_plane", "date": date, "config": config, "machine": machine(),
              "metrics": metrics, "ratios": ratios(metrics)}
    path = write_json(report, args.out)
    print_table(report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
