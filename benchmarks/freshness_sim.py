"""Simulated mode of the freshness benchmark: the real pipeline, with modelled generation and training time.

    python -m benchmarks.freshness_sim --run-dir runs/fresh --workers 8 --steps 40 --max-staleness 1 \\
        --set tokens_per_s_per_worker=40 --set train_s_per_token=2e-4 --set weight_bytes=14e9 \\
        --set sync_s_per_byte=1e-10 --set max_new_tokens=32768 --set time_scale=60

(``benchmarks/freshness.py`` sweeps points through :func:`run_point` and analyses the results.)

One point = one trainer (this process, no process group) consuming a real :class:`~asyncrl.RolloutLoader`
with ``num_workers`` real worker processes, for ``steps`` optimizer steps::

    trainer (this thread)                          workers × N (processes, fake engine)
    ─────────────────────                          ────────────────────────────────────
    batch = next(loader)      ◄══ ZeroMQ groups ══ lease → generate: sleep longest_row / tokens_per_s
    sleep train_s                                  (static batching: max_batch leases × group_size rows;
                                                    streaming: each sequence its own length / tokens_per_s,
                                                    max_num_seqs at once, each group sent when done)
    version += 1                                   safe point: staged update? apply: sleep weight_load_s,
    sleep publish_s, broadcaster.publish(small)  ══shm══►       adopt its version, commit
    loader.set_policy_version(version)

Real: the worker processes and their start-up, the ledger, leases and credits, the pool with its staleness
drops and regeneration, ZeroMQ transport and msgpack encode/decode of every rollout (real token and logprob
arrays of the modelled lengths), collate into padded tensors, the fake reward, and weight sync (a real shm
broadcaster publishes a small tensor dict each version; receivers stage, checksum, apply and commit it, so
rollouts carry the version a worker really had). Modelled, as sleeps divided by ``time_scale``: decode time
(``seconds_per_token`` of the fake engine), the trainer's step (``train_s_fixed + train_s_per_token *
batch_tokens``), the publish time of ``weight_bytes`` (trainer side, before the real publish, so workers see
a version only after its modelled transfer) and the worker-side load (``weight_load_s``, at the worker's
safe point). Who blocks on what: the trainer blocks in ``next(loader)`` (``wait_s``), in the training sleep
and in publishing; a worker blocks in its generation sleep and in its weight-load sleep; nothing else waits.

Time: every duration in ``metrics.jsonl`` is REAL wall seconds. Modelled durations are divided by
``time_scale`` before they are slept (a 1-hour regime runs in 1 minute at ``time_scale=60``); real overheads
(sockets, encode/decode, collate, Python) are not, so they weigh ``time_scale`` times more than they would
in the modelled system. Analyses multiply wall seconds by ``time_scale`` (each line carries it) to report
modelled time, and should check that the real overheads stay small against the scaled sleeps.

Outputs in ``run_dir``: ``config.json`` (the :class:`SimConfig`, the point, the derived engine/loader
settings, the machine), ``metrics.jsonl`` (one line per step, the schema of ``recipes/grpo.py`` without the
model-specific keys, plus ``modelled`` and ``time_scale``) and ``overheads.json`` (worker start-up time, worker
and trainer memory: what limits the scale).

What limits the scale (2 vCPU, 23 GiB, shared with other jobs; measured 2026-12, see ``overheads.json``):
- start-up: a worker imports torch for the codec, ~2 s of CPU; 4-16 workers connect in 3-30 s, 64 in 160 s
  (load average ~60 while they start). The clock starts only once every worker has said hello.
- memory: a worker is ~230 MB RSS, ~150 MB of it private (PSS ~150 MB): 64 workers ~9.6 GB.
- real per-step work that is not scaled: decoding every rollout on the receiver thread (including those
  later dropped as stale), collate into padded tensors (inside ``next(loader)``, so counted in ``wait_s``),
  token and logprob arrays of the modelled lengths on the workers. Its floor, measured with
  ``time_scale=1e6`` (sleeps ~0) on a 7B-like regime (32 rollouts, ~55k tokens a step): ~45 ms a step with
  4 workers, ~70 ms with 16. It appears as ``time_scale`` x that many modelled seconds, so keep
  ``time_scale`` below ~(modelled step time) / (20 x floor) for errors under ~5 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WeightSyncConfig, WorkerConfig
from asyncrl.codec import dumps_json
from asyncrl.weights import WeightBroadcaster, setup_weight_broadcaster
from benchmarks._report import machine

__all__ = ["SimConfig", "loader_capacity", "run_point"]

MAX_LAG_BIN = 16
"""``staleness_hist[i]`` counts the step's rollouts ``i`` versions behind the trainer (the last bin: i or more)."""
REAL_WEIGHT_NUMEL = 4096
"""Elements of the float32 tensor really published per version (the modelled size is ``weight_bytes``)."""
PIPELINE_KEYS = ("busy_s", "uptime_s", "weight_apply_s", "rollouts_sent", "tokens_generated", "policy_version",
                 "busy_seq_s", "capacity_seq_s", "inflight_updates", "inflight_pause_p50_s", "inflight_pause_p99_s",
                 "groups_resubmitted")


@dataclass(slots=True)
class SimConfig:
    """The time model of one regime: how fast workers decode, the trainer trains and weights move."""

    tokens_per_s_per_worker: float
    """Decode throughput of one worker, tokens/s per sequence: a static batch takes longest_row / this."""
    train_s_per_token: float
    """Trainer step time per token of the batch (prompt + response of every rollout)."""
    train_s_fixed: float = 0.0
    """Fixed overhead per trainer step."""
    sync_s_per_byte: float = 0.0
    """Weight publish time per byte (trainer side; blocks the trainer)."""
    weight_bytes: int = 0
    """Modelled size of one weight update (14e9 for a 7B model in bf16)."""
    load_s_per_byte: float = 0.0
    """Worker-side weight load time per byte (blocks that worker at its safe point)."""
    length_median: int = 256
    length_tail: float = 1.0
    """Sigma of the lognormal response length; 0 = uniform in [min_new_tokens, max_new_tokens]."""
    min_new_tokens: int = 16
    max_new_tokens: int = 4096
    prompt_tokens: int = 64
    group_size: int = 4
    batch_size: int = 8
    """Groups per trainer step."""
    max_batch: int = 4
    """Leases per engine call."""
    slots: int = 8
    """Leases (credits) a worker holds at once (streaming: leases whose requests are in the engine at once)."""
    streaming: bool = False
    """The workers' loop: False = static batches (``max_batch`` leases per call, each waits for its longest row),
    True = streaming (continuous batching, ``worker.streaming``; updates applied in flight)."""
    streaming_slots: int = 0
    """Streaming: leases whose requests are in the engine at once (``worker.slots`` of a streaming worker); 0 =
    ``slots``. A streaming engine stays full only while enough leases are in it: a group's last samples hold
    its lease while the others' slots are free, so it wants several times ``max_num_seqs / group_size``."""
    max_num_seqs: int = 0
    """Sequences the fake engine decodes at once when streaming (its occupancy width in both loops); 0 =
    ``max_batch * group_size``, a static call's rows, so both loops have the same engine."""
    time_scale: float = 1.0
    """Every modelled duration is divided by this before it is slept; real overheads are not."""
    seed: int = 0

    def __post_init__(self):
        if self.tokens_per_s_per_worker <= 0 or self.time_scale <= 0:
            raise ValueError(f"need {self.tokens_per_s_per_worker=} > 0 and {self.time_scale=} > 0")
        rates = {k: getattr(self, k) for k in ("train_s_per_token", "train_s_fixed", "sync_s_per_byte",
                                                "load_s_per_byte", "weight_bytes", "length_tail")}
        if any(v < 0 for v in rates.values()):
            raise ValueError(f"time-model terms must be >= 0, got {rates}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need 0 <= {self.min_new_tokens=} <= {self.max_new_tokens=}")
        if self.max_num_seqs < 0 or self.streaming_slots < 0:
            raise ValueError(f"{self.max_num_seqs=} and {self.streaming_slots=} must be >= 0 (0: the default)")
        if min(self.prompt_tokens, self.group_size, self.batch_size, self.max_batch, self.slots) < 1:
            raise ValueError("prompt_tokens, group_size, batch_size, max_batch and slots must all be >= 1")

    @classmethod
    def from_measured(cls, summary: dict[str, Any], **overrides: Any) -> SimConfig:
        """A time model from a measured run's summary (keys as ``benchmarks/freshness.py`` writes them).

        Args:
            summary: measured terms; missing or None keys keep the defaults.
            **overrides: SimConfig fields that replace the measured values (e.g. ``time_scale``).

        Raises:
            ValueError: if a required rate is in neither ``summary`` nor ``overrides``.
        """
        types = {f.name: f.type for f in dataclasses.fields(cls)}  # strings: annotations are postponed
        kwargs: dict[str, Any] = {}
        for key, name in _MEASURED.items():
            if summary.get(key) is not None:
                kwargs[name] = int(round(summary[key])) if types[name] == "int" else float(summary[key])
        kwargs |= overrides
        missing = [name for name in _REQUIRED if name not in kwargs]
        if missing:
            raise ValueError(f"from_measured: {missing} not in summary {sorted(summary)} nor in overrides")
        return cls(**kwargs)

    def worker_slots(self) -> int:
        """The credits each worker holds: ``streaming_slots`` (or ``slots``) when streaming, else ``slots``."""
        return (self.streaming_slots or self.slots) if self.streaming else self.slots

    def engine_width(self) -> int:
        """The engine's sequence capacity (``engine.max_num_seqs``), the same in both loops."""
        return self.max_num_seqs or self.max_batch * self.group_size

    def seconds_per_token(self) -> float:
        """The fake engine's sleep per token of a batch's longest row (wall seconds)."""
        return 1.0 / (self.tokens_per_s_per_worker * self.time_scale)

    def weight_load_s(self) -> float:
        """A worker's sleep per applied version (wall seconds)."""
        return self.load_s_per_byte * self.weight_bytes / self.time_scale

    def publish_s(self) -> float:
        """The trainer's modelled publish time per version, in modelled seconds."""
        return self.sync_s_per_byte * self.weight_bytes

    def train_s(self, batch_tokens: int) -> float:
        """The trainer's modelled step time for a batch, in modelled seconds."""
        return self.train_s_fixed + self.train_s_per_token * batch_tokens


_REQUIRED = ("tokens_per_s_per_worker", "train_s_per_token")
_MEASURED = {
    # per sequence of a statically batched call (a call takes longest_row / this), not the worker's aggregate
    # tokens/s: freshness.py derives it from the measured calls; the aggregate would be rows_per_call x too fast
    "decode_tokens_per_s_per_sequence": "tokens_per_s_per_worker",
    "train_s_per_token": "train_s_per_token",
    "train_s_fixed": "train_s_fixed",
    "publish_s_per_byte": "sync_s_per_byte",
    "weight_bytes": "weight_bytes",
    "apply_s_per_byte": "load_s_per_byte",
    "length_median": "length_median",
    "length_tail": "length_tail",
    "max_new_tokens": "max_new_tokens",
    "group_size": "group_size",
    "batch_size": "batch_size",
    "prompt_tokens": "prompt_tokens",
    "min_new_tokens": "min_new_tokens",
    "max_batch": "max_batch",
    "slots": "slots",
}


def loader_capacity(sim: SimConfig, *, max_staleness: int, num_workers: int) -> int:
    """Groups leased + buffered at once: large enough that neither swept axis is capped by the pool.

    ``num_workers * slots`` lets every worker use all its credits, so adding workers adds generation (the
    worker axis measures workers, not this bound); ``2 * batch_size * (max_staleness + 1)`` holds the
    ``max_staleness + 1`` steps of groups that may still be trained on, twice, so the next window is
    generated while this one is consumed. Anything produced beyond what the trainer consumes in time is
    dropped as stale and regenerated, and counted (``pipeline.stale_dropped``): the cost of too many
    workers shows up as waste and staleness, not as idle workers.
    """
    return max(num_workers * sim.worker_slots(), 2 * sim.batch_size * (max_staleness + 1))


def _loader_config(sim: SimConfig, *, max_staleness: int, num_workers: int, weights_address: str) -> LoaderConfig:
    engine = FakeEngineConfig(
        seed=sim.seed,
        min_new_tokens=sim.min_new_tokens,
        max_new_tokens=sim.max_new_tokens,
        length_tail=sim.length_tail,
        length_median=sim.length_median,
        seconds_per_token=sim.seconds_per_token(),
        weight_load_s=sim.weight_load_s(),
        max_num_seqs=sim.engine_width(),
    )
    worker = WorkerConfig(
        engine=engine,
        reward="fake",
        weights=WeightSyncConfig(type="shm", address=weights_address),
        slots=sim.worker_slots(),
        max_batch=sim.max_batch,
        streaming=bool(sim.streaming),
    )
    # the longest engine call plus a weight load: a lease held (or a pipeline silent) for several of these is
    # lost, not a long tail; below the 300 s default a long call at a small time_scale would be re-leased
    longest_call_s = sim.max_new_tokens * sim.seconds_per_token() + sim.weight_load_s()
    return LoaderConfig(
        group_size=sim.group_size,
        batch_size=sim.batch_size,
        max_staleness=max_staleness,
        capacity=loader_capacity(sim, max_staleness=max_staleness, num_workers=num_workers),
        seed=sim.seed,
        num_workers=num_workers,
        wait_timeout_s=120.0 + 4 * longest_call_s,
        lease_timeout_s=max(300.0, 4 * longest_call_s),
        # heartbeats carry the worker stats logged per step (fresher than the 1 s default); many workers starting
        # on few cores delay them, so a worker is declared dead only after a minute
        transport=TransportConfig(heartbeat_s=0.5, peer_timeout_s=60.0, handshake_timeout_s=300.0),
        worker=worker,
    )


def _pipeline_stats(loader: RolloutLoader) -> dict[str, Any]:
    """Cumulative counters of the pool and what its workers report (as ``recipes/grpo.py`` logs them)."""
    stats = loader.stats()
    return {
        "stale_dropped": stats["pool"].get("stale_dropped", 0),
        "regenerated": stats["ledger"].get("regenerated", 0),
        "rollouts_received": stats["pool"].get("rollouts_received", 0),
        "bad_messages": stats["transport"].get("bad_messages", 0),
        "workers": {w: {k: v[k] for k in PIPELINE_KEYS if k in v}
                    for w, v in stats["transport"].get("workers", {}).items()},
    }


def _process_memory(pid: int) -> dict[str, float] | None:
    """RSS and PSS (MB) of a process from ``/proc``; None if it is gone or unreadable."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if line.endswith("kB")}
    return {name: kb.get(key, 0) / 1024 for name, key in (("rss_mb", "Rss"), ("pss_mb", "Pss"), ("anon_mb", "Anonymous"))}


def _wait_for_workers(loader: RolloutLoader, num_workers: int, timeout: float) -> float:
    """Blocks until every local worker said hello to the pool (before any lease is granted); returns the seconds."""
    t0 = time.perf_counter()
    while len(loader.stats()["transport"].get("workers", {})) < num_workers:
        if loader.launcher is not None and loader.launcher.alive() < num_workers:
            raise RuntimeError(f"a worker exited during start-up (pids {loader.launcher.pids}); see its stderr above")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"only {len(loader.stats()['transport'].get('workers', {}))} of {num_workers} workers "
                               f"connected within {timeout:.0f} s; fewer workers or a larger machine")
        time.sleep(0.2)
    return time.perf_counter() - t0


def _publish(broadcaster: WeightBroadcaster, version: int, modelled_s: float, time_scale: float) -> float:
    """Sleeps the modelled transfer, then really publishes a small tensor dict as ``version``; wall seconds."""
    t0 = time.perf_counter()
    if modelled_s > 0:
        time.sleep(modelled_s / time_scale)
    broadcaster.publish({"weight": torch.full((REAL_WEIGHT_NUMEL,), float(version))}, version, mode="full")
    return time.perf_counter() - t0


def _step_record(sim: SimConfig, batch: dict[str, Any], version: int) -> dict[str, Any]:
    staleness = (version - batch["policy_versions"]).float()  # at consumption, before this step's update
    return {
        "accepted": True,
        "loss": 0.0,
        "reward_mean": float(batch["rewards"].mean()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "staleness_hist": torch.bincount(staleness.long().clamp(0, MAX_LAG_BIN), minlength=MAX_LAG_BIN + 1).tolist(),
        "tokens": float(batch["num_tokens"]),
        "weight_bytes": sim.weight_bytes,
    }


def run_point(sim: SimConfig, *, max_staleness: int, num_workers: int, steps: int, run_dir: Path) -> Path:
    """Runs one (time model, max_staleness, num_workers) point for ``steps`` trainer steps.

    Args:
        sim: the time model.
        max_staleness: the loader's bound (0 = synchronous).
        num_workers: local worker processes.
        steps: trainer steps to log (the clock starts once every worker is connected).
        run_dir: where ``config.json``, ``metrics.jsonl`` and ``overheads.json`` go (created).

    Returns:
        The path of ``metrics.jsonl``.
    """
    if steps < 1 or num_workers < 1 or max_staleness < 0:
        raise ValueError(f"need {steps=} >= 1, {num_workers=} >= 1 and {max_staleness=} >= 0")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    broadcaster = setup_weight_broadcaster("shm")  # a fresh /dev/shm directory, removed on close
    loader: RolloutLoader | None = None
    try:
        _publish(broadcaster, 0, 0.0, sim.time_scale)  # workers start from version 0's weights
        config = _loader_config(sim, max_staleness=max_staleness, num_workers=num_workers,
                                weights_address=broadcaster.address)
        # every step consumes batch_size prompts (regenerated ones reuse theirs); never end the epoch
        num_prompts = 2 * steps * sim.batch_size + config.capacity
        prompts = [{"prompt_ids": list(range(1, sim.prompt_tokens + 1))}] * num_prompts
        (run_dir / "config.json").write_bytes(dumps_json({
            "sim": dataclasses.asdict(sim),
            "point": {"max_staleness": max_staleness, "num_workers": num_workers, "steps": steps},
            "derived": {"seconds_per_token": sim.seconds_per_token(), "weight_load_s": sim.weight_load_s(),
                        "publish_sleep_s": sim.publish_s() / sim.time_scale, "capacity": config.capacity,
                        "num_prompts": num_prompts, "real_weight_bytes": 4 * REAL_WEIGHT_NUMEL},
            "loader": dataclasses.asdict(config),
            "machine": machine(),
        }))
        loader = RolloutLoader(prompts, config)
        connect_s = _wait_for_workers(loader, num_workers, timeout=60.0 + 10.0 * num_workers)
        memory = [_process_memory(pid) for pid in loader.launcher.pids if pid is not None]
        _train(sim, loader, broadcaster, steps, run_dir / "metrics.jsonl")
        memory_end = [_process_memory(pid) for pid in loader.launcher.pids if pid is not None]
        (run_dir / "overheads.json").write_bytes(dumps_json({
            "workers_connected_s": connect_s,
            "worker_memory_at_start": [m for m in memory if m],
            "worker_memory_at_end": [m for m in memory_end if m],
            "trainer_memory_at_end": _process_memory(os.getpid()),
        }))
    finally:
        if loader is not None:
            loader.close()
        broadcaster.close()
        shutil.rmtree(broadcaster.address, ignore_errors=True)
    return run_dir / "metrics.jsonl"


def _train(sim: SimConfig, loader: RolloutLoader, broadcaster: WeightBroadcaster, steps: int, path: Path) -> None:
    """The modelled trainer: consume a batch, sleep its step, publish the next version; one line per step."""
    version = 0
    loader.set_policy_version(version)
    it = iter(loader)
    with open(path, "wb") as out:
        t_last = time.perf_counter()
        for step in range(1, steps + 1):
            try:
                batch = next(it)
            except StopIteration:
                raise RuntimeError(f"the epoch ended at step {step}; run_point sizes prompts to avoid this") from None
            wait_s = time.perf_counter() - t_last
            record = {"step": step, **_step_record(sim, batch, version)}
            train_modelled = sim.train_s(int(batch["num_tokens"]))
            t0 = time.perf_counter()
            time.sleep(train_modelled / sim.time_scale)
            train_s = time.perf_counter() - t0
            version += 1
            publish_s = _publish(broadcaster, version, sim.publish_s(), sim.time_scale)
            loader.set_policy_version(version)
            now = time.perf_counter()
            step_s = now - t_last
            t_last = now
            record |= {
                "policy_version": version,
                "publish_s": publish_s,
                "train_s": train_s,
                "step_s": step_s,
                "wait_s": wait_s,
                "rollouts_per_s": len(batch["uids"]) / max(step_s, 1e-9),
                "time": time.time(),
                "time_scale": sim.time_scale,
                "modelled": {"train_s": train_modelled, "publish_s": sim.publish_s(), "time_scale": sim.time_scale},
                "pipeline": _pipeline_stats(loader),
            }
            out.write(dumps_json(record) + b"\n")
            out.flush()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a SimConfig field")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fields = {f.name: f.type for f in dataclasses.fields(SimConfig)}
    values: dict[str, Any] = {"tokens_per_s_per_worker": 1000.0, "train_s_per_token": 1e-5}
    for item in args.set:
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {item!r}: unknown SimConfig field; known: {sorted(fields)}")
        values[key] = (int(float(raw)) if fields[key] == "int" else raw.lower() in ("1", "true", "yes")
                       if fields[key] == "bool" else float(raw))
    path = run_point(SimConfig(**values), max_staleness=args.max_staleness, num_workers=args.workers,
                     steps=args.steps, run_dir=Path(args.run_dir))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
