"""The pool process of ``benchmarks/control_plane.py``: one trainer rank's pool and receiver, and a trainer that takes.

Run by path, with ``PYTHONPATH`` naming the tree under test (this checkout, or an older commit exported by the
benchmark), so it uses only what every tree has: ``PromptLedger``, ``RolloutPool``, ``ZmqRolloutReceiver`` (found
under the module paths of either layout).

The trainer thread takes groups, commits each batch and sets the next policy version (a training step that costs
nothing), while it is told to consume. Commands come as JSON lines on stdin, answers as JSON lines on stdout:

    {"cmd": "consume", "on": true|false}   start or stop taking groups
    {"cmd": "snapshot"}                     groups taken; CPU seconds of the process, the receiver's I/O thread and the
                                            trainer thread; the receiver's counters; leases outstanding, groups buffered
    {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import asyncrl
from asyncrl.config import GateConfig, TransportConfig

try:  # the layout with packages
    from asyncrl.pool.buffer import RolloutPool
    from asyncrl.pool.ledger import PromptLedger
    from asyncrl.transport.zmq import ZmqRolloutReceiver
except ImportError:  # the flat one before it
    from asyncrl.ledger import PromptLedger  # type: ignore[no-redef]
    from asyncrl.transport.zmq_transport import ZmqRolloutReceiver  # type: ignore[no-redef]

    from asyncrl.pool import RolloutPool  # type: ignore[no-redef]

COUNTERS = ("messages", "leases_granted", "groups_received", "workers_joined", "groups_refused", "bad_messages",
            "leases_expired", "workers_lost", "leases_undeliverable")


def _thread_cpu(thread: threading.Thread | None) -> float | None:
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:
        return None


class Trainer:
    """Takes groups, one step per ``batch_size`` (commit, then the next policy version), while ``consuming``."""

    def __init__(self, pool: RolloutPool, batch_size: int):
        self.pool = pool
        self.batch_size = batch_size
        self.consuming = threading.Event()
        self.stop = threading.Event()
        self.groups = 0
        self.thread = threading.Thread(target=self._run, name="trainer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        batch: list[int] = []
        while not self.stop.is_set():
            if not self.consuming.wait(0.5):
                continue
            group = self.pool.take(timeout=0.5)
            if group is None:
                continue
            self.groups += 1
            batch.append(group.prompt_index)
            if len(batch) == self.batch_size:
                self.pool.commit(self.pool.ledger.epoch, batch)
                self.pool.set_policy_version(self.pool.policy_version + 1)
                batch = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=1 << 20)
    ap.add_argument("--prompts", type=int, default=400_000)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--max-peers", type=int, default=256)
    args = ap.parse_args()

    ledger = PromptLedger(args.prompts, shuffle=False)
    pool = RolloutPool(ledger, group_size=args.group_size, capacity=args.capacity, max_staleness=args.max_staleness,
                       groups_per_step=args.batch_size, max_prompt_failures=None)
    pool.start_epoch(0)
    transport = TransportConfig(heartbeat_s=args.heartbeat_s, peer_timeout_s=max(10.0, 10 * args.heartbeat_s))
    receiver = ZmqRolloutReceiver(transport, pool, lambda i: {"prompt_ids": [1, 2, 3]},
                                  gate=GateConfig(max_peers=args.max_peers))
    endpoint = receiver.start()
    io_thread = next((t for t in threading.enumerate() if t.name.startswith("asyncrl-receiver")), None)
    trainer = Trainer(pool, args.batch_size)
    print(json.dumps({"endpoint": endpoint, "asyncrl": asyncrl.__file__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "consume":
            (trainer.consuming.set if cmd["on"] else trainer.consuming.clear)()
            out: dict = {"ok": True}
        elif cmd["cmd"] == "snapshot":
            stats = receiver.stats()
            with pool.cond:
                leased, buffered = len(pool.ledger.leases), len(pool._ready)
            out = {"t": time.monotonic(), "groups": trainer.groups, "process_cpu_s": time.process_time(),
                   "receiver_cpu_s": _thread_cpu(io_thread), "trainer_cpu_s": _thread_cpu(trainer.thread),
                   "counters": {k: stats.get(k, 0) for k in COUNTERS}, "leased": leased, "buffered": buffered,
                   "policy_version": pool.policy_version, "workers": len(stats["workers"])}
        else:
            break
        print(json.dumps(out), flush=True)
    trainer.stop.set()
    receiver.close()


if __name__ == "__main__":
    main()
