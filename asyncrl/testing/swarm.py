"""A swarm of simulated rollout workers: many DEALERs in one thread speaking the rollout protocol.

For tests and benchmarks of the control plane: one pool fed by hundreds of workers on a machine with two cores.
Each simulated worker greets the pool (HELLO with its ``slots``, static or ``streaming``), answers every lease with a
valid group of ``group_size`` tiny rollouts once its engine is done, heartbeats with a status the size of a real
worker's (answering the pool's heartbeat when its own is due within half an interval, as a real worker's sender
does), obeys CANCEL, RESYNC and SHUTDOWN, and says BYE when the swarm closes. What it sends passes the pool's
decoder and gate like a real worker's; nothing else of a worker runs (no engine, reward or weights).

The engine is a clock: an engine call takes ``service_s`` of wall time (0: an engine that costs nothing; ``jitter``
spreads each call's time uniformly over ``service_s × (1 ± jitter)``, as response lengths would). A static
worker runs at most ``max_batch`` leases per call and one call at a time (the static loop); a streaming one runs each
lease as its own call, every lease it holds at once (continuous batching).

What it measures, per worker: the groups sent; for every credit freed (a group sent) the seconds until the pool
granted a lease again (the credit round trip, :meth:`Swarm.take_waits`); and the seconds from a worker's first HELLO to
its first lease.

Threads: one I/O thread owns every socket and blocks in a poll until a message, its next timer (an engine call
finishing, a heartbeat, a HELLO retry) or :meth:`Swarm.close`; the caller's thread reads the counters (under a lock).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from asyncrl._zmq.io import IOThread, Waker, drain
from asyncrl.codec import DecodeError, decode, encode
from asyncrl.rollout import make_group_id, make_uid
from asyncrl.transport import protocol as P
from asyncrl.transport.zmq import HELLO_RETRY_S

__all__ = ["Swarm"]

_STATUS = ("policy_version", "groups_sent", "rollouts_sent", "tokens_generated", "busy_s", "weight_apply_s",
           "uptime_s", "leases_failed", "log_lines_suppressed", "weight_sync_failures", "weight_apply_failures",
           "busy_seq_s")
"""The keys of a static worker's status without weight verification: what each simulated heartbeat carries."""


@dataclass(slots=True)
class _Sim:
    index: int
    worker_id: str
    sock: zmq.Socket
    welcomed: bool = False
    shutdown: bool = False
    hello_at: float = math.nan
    hello_retry: float = HELLO_RETRY_S
    next_heartbeat: float = 0.0
    first_lease_s: float | None = None
    first_lease_id: int | None = None
    queued: collections.deque = field(default_factory=collections.deque)
    busy: bool = False
    groups: int = 0
    freed: collections.deque = field(default_factory=collections.deque)
    policy_version: int = 0


class Swarm:
    """``n`` simulated workers connected to one pool (see the module docstring).

    Args:
        endpoint: the pool's endpoint.
        n: how many workers.
        slots: credits each asks for in HELLO.
        streaming: say ``streaming`` in HELLO and run each lease on its own (else: the static loop).
        max_batch: a static worker's leases per engine call.
        service_s: wall seconds of one engine call.
        jitter: each call takes ``service_s × (1 + jitter × u)``, ``u`` uniform in [-1, 1] (seeded: the same run
            draws the same times).
        group_size: rollouts per group (the pool's).
        heartbeat_s: the channel's heartbeat interval (``transport.heartbeat_s``).
        tokens: response tokens per rollout.
        prefix: worker ids are ``{prefix}{i}``.
    """

    def __init__(self, endpoint: str, n: int, *, slots: int = 8, streaming: bool = False, max_batch: int = 4,
                 service_s: float = 0.0, jitter: float = 0.0, group_size: int = 4, heartbeat_s: float = 1.0,
                 tokens: int = 4, prefix: str = "sim", seed: int = 0):
        if n < 1 or slots < 1 or max_batch < 1 or service_s < 0 or group_size < 1 or not 0 <= jitter <= 1:
            raise ValueError(f"need {n=}, {slots=}, {max_batch=}, {group_size=} >= 1, {service_s=} >= 0 and "
                             f"{jitter=} in [0, 1]")
        self.endpoint = endpoint
        self.n = n
        self.slots = slots
        self.streaming = streaming
        self.max_batch = max_batch
        self.service_s = service_s
        self.jitter = jitter
        self._rng = random.Random(seed)
        self.group_size = group_size
        self.heartbeat_s = heartbeat_s
        self.prefix = prefix
        self._ids = torch.arange(1, tokens + 1, dtype=torch.int32)
        self._logprobs = torch.full((tokens,), -0.5, dtype=torch.float32)
        self._io = IOThread(self, f"asyncrl-swarm-{prefix}")
        self._waker = Waker(self._io.ctx, f"swarm-{id(self):x}")
        self._lock = threading.Lock()
        self._welcomed = threading.Event()
        self._error: BaseException | None = None
        self._sims: list[_Sim] = []
        self._waits: list[float] = []
        self._last_lease_id = 0
        self.counters: collections.Counter[str] = collections.Counter()

    # -- caller's thread ---------------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> Swarm:
        """Connects every worker and waits until the pool welcomed them all.

        Raises:
            TimeoutError: naming how many were welcomed.
        """
        self._io.start(self._run)
        if not self._welcomed.wait(timeout) or self._error is not None:
            welcomed = sum(s.welcomed for s in self._sims)
            self.close()
            raise TimeoutError(f"swarm: {welcomed} of {self.n} workers welcomed by {self.endpoint} within {timeout} s"
                               ) from self._error
        return self

    def groups(self) -> dict[str, int]:
        """Groups each worker has sent so far."""
        with self._lock:
            return {s.worker_id: s.groups for s in self._sims}

    def first_lease_s(self) -> dict[str, float | None]:
        """Seconds from each worker's first HELLO to its first lease (None: none yet)."""
        with self._lock:
            return {s.worker_id: s.first_lease_s for s in self._sims}

    def first_lease_id(self) -> dict[str, int | None]:
        """The id of each worker's first lease (None: none yet). Lease ids grow with every grant of the pool, so the
        ids say in which order leases were granted, whatever the threads' timing."""
        with self._lock:
            return {s.worker_id: s.first_lease_id for s in self._sims}

    def last_lease_id(self) -> int:
        """The highest lease id any of these workers received so far (0: none)."""
        with self._lock:
            return self._last_lease_id

    def take_waits(self) -> list[float]:
        """The credit round trips measured since the last call: seconds from a group sent to the next lease granted."""
        with self._lock:
            waits, self._waits = self._waits, []
        return waits

    def cpu_s(self) -> float | None:
        """CPU seconds the swarm's I/O thread has used (None: not running)."""
        thread = self._io.thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return None
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))

    def close(self) -> None:
        """BYE from every worker the pool did not shut down, then the sockets are closed."""
        self._io.close(before_join=self._waker.wake if self._io.started else None)

    # -- I/O thread ---------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        wake = self._waker.pull()
        for i in range(self.n):
            sock = self._io.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 500)
            sock.connect(self.endpoint)
            self._sims.append(_Sim(i, f"{self.prefix}{i}", sock))
        try:
            self._loop(wake)
        except BaseException as e:  # thread boundary: start() raises it
            self._error = e
            self._welcomed.set()
            raise
        finally:
            self._waker.close()
            wake.close(linger=0)
            for s in self._sims:
                if not s.shutdown:
                    self._send(s, P.BYE, {})
                s.sock.close()

    def _loop(self, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        by_sock = {}
        for s in self._sims:
            poller.register(s.sock, zmq.POLLIN)
            by_sock[s.sock] = s
        # one timer per worker: its next HELLO until welcomed, then its next heartbeat
        now = time.monotonic()
        self._timers = [(now, s.index) for s in self._sims]
        heapq.heapify(self._timers)
        self._due: list[tuple[float, int, int, list[dict]]] = []  # (when, seq, worker, leases): engine calls running
        self._seq = itertools.count()
        self._idle_with_work: set[int] = set()  # workers with leases queued and no engine call running
        while not self._io.stop.is_set():
            timer = min(self._timers[0][0], self._due[0][0] if self._due else math.inf)
            if self._idle_with_work:
                timer = 0.0
            for sock, _ in poller.poll(max(0, math.ceil((timer - time.monotonic()) * 1000))):
                if sock is wake:
                    drain(wake, _ignore, 1 << 20)
                else:
                    s = by_sock[sock]
                    drain(sock, lambda frames, s=s: self._handle(s, frames), 256)
            now = time.monotonic()
            while self._timers[0][0] <= now:
                _, index = heapq.heappop(self._timers)
                s = self._sims[index]
                if not s.welcomed:
                    if self._hello(s, now):
                        s.next_heartbeat = now + self.heartbeat_s * (0.5 + index / self.n)  # spread, as processes' are
                    else:  # the connection is not made yet (IMMEDIATE): retried soon, backing off, as a real worker
                        s.next_heartbeat, s.hello_retry = now + s.hello_retry, min(self.heartbeat_s, 2 * s.hello_retry)
                elif now >= s.next_heartbeat and not s.shutdown:
                    self._heartbeat(s, now)
                heapq.heappush(self._timers, (s.next_heartbeat, index))
            for index in self._idle_with_work:  # engine calls start
                s = self._sims[index]
                k = len(s.queued) if self.streaming else min(self.max_batch, len(s.queued))
                leases = [s.queued.popleft() for _ in range(k)]
                for call in ([[lease] for lease in leases] if self.streaming else [leases]):
                    took = self.service_s * (1 + self.jitter * self._rng.uniform(-1, 1))
                    heapq.heappush(self._due, (now + took, next(self._seq), index, call))
                s.busy = not self.streaming
            self._idle_with_work.clear()
            while self._due and self._due[0][0] <= now:
                _, _, index, leases = heapq.heappop(self._due)
                s = self._sims[index]
                s.busy = False
                if not s.shutdown:
                    for lease in leases:
                        self._send(s, P.GROUP, {"lease_id": lease["lease_id"], "group": self._group(s, lease)})
                    with self._lock:
                        s.groups += len(leases)
                        s.freed.extend([time.monotonic()] * len(leases))
                if s.queued and not s.shutdown:
                    self._idle_with_work.add(index)
            if not self._welcomed.is_set() and all(s.welcomed for s in self._sims):
                self._welcomed.set()
    def _handle(self, s: _Sim, frames: list[zmq.Frame]) -> None:
        try:
            kind, body = decode(frames)
            P.check_body(kind, body, P.POOL_KINDS)
        except DecodeError:
            self.counters["bad_messages"] += 1
            return
        now = time.monotonic()
        if kind == P.WELCOME:
            s.welcomed = True
        elif kind == P.LEASES:
            s.policy_version = max(s.policy_version, body["policy_version"])
            leases = [dict(lease, policy_version=body["policy_version"], incarnation=body.get("incarnation", ""))
                      for lease in body["leases"]]
            with self._lock:
                if s.first_lease_s is None:
                    s.first_lease_s = now - s.hello_at
                    s.first_lease_id = min(lease["lease_id"] for lease in leases) if leases else None
                self._last_lease_id = max([self._last_lease_id, *(lease["lease_id"] for lease in leases)])
                for _ in leases:
                    if s.freed:
                        self._waits.append(now - s.freed.popleft())
            s.queued.extend(leases)
            self.counters["leases"] += len(leases)
            if not s.busy:
                self._idle_with_work.add(s.index)
        elif kind == P.HEARTBEAT:
            if isinstance(body.get("policy_version"), int):
                s.policy_version = max(s.policy_version, body["policy_version"])
            if s.welcomed and not s.shutdown and now >= s.next_heartbeat - self.heartbeat_s / 2:
                self._heartbeat(s, now)  # answered at once when due soon, as a real worker does
        elif kind == P.CANCEL:
            floor = body.get("min_lease_id")
            kept = [x for x in s.queued if isinstance(floor, int) and x["lease_id"] >= floor]
            self.counters["leases_cancelled"] += len(s.queued) - len(kept)
            s.queued = collections.deque(kept)
            if not kept:
                self._idle_with_work.discard(s.index)
        elif kind == P.RESYNC:
            self._hello(s, now)
        elif kind == P.SHUTDOWN:
            if not s.shutdown:
                self._send(s, P.BYE, {})
            s.shutdown = True
            self._idle_with_work.discard(s.index)

    def _hello(self, s: _Sim, now: float) -> bool:
        """Whether the HELLO left (see :meth:`_send`)."""
        if math.isnan(s.hello_at):
            s.hello_at = now
        body = {"worker_id": s.worker_id, "slots": self.slots, "pid": 0, "host": "swarm", "protocol": P.PROTOCOL_VERSION}
        if self.streaming:
            body["streaming"] = True
        return self._send(s, P.HELLO, body)

    def _heartbeat(self, s: _Sim, now: float) -> None:
        self._send(s, P.HEARTBEAT, {"status": self._status(s)})
        s.next_heartbeat = now + self.heartbeat_s

    def _send(self, s: _Sim, kind: str, body: dict[str, Any]) -> bool:
        """Whether the message left: not while the connection is not made yet (``IMMEDIATE``) or its queue is full."""
        try:
            s.sock.send_multipart(encode(kind, body), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters[f"send_dropped_{kind}"] += 1
            return False
        return True

    def _status(self, s: _Sim) -> dict[str, int | float]:
        values = {"policy_version": s.policy_version, "groups_sent": s.groups, "rollouts_sent": s.groups * self.group_size}
        return {key: values.get(key, 0) for key in _STATUS}

    def _group(self, s: _Sim, lease: dict[str, Any]) -> dict[str, Any]:
        epoch, index = lease["epoch"], lease["prompt_index"]
        rollouts = [{
            "uid": make_uid(epoch, index, sample), "group_id": make_group_id(epoch, index), "epoch": epoch,
            "prompt_index": index, "sample_index": sample, "worker_id": s.worker_id,
            "policy_version": lease["policy_version"], "incarnation": lease["incarnation"], "version_spans": [],
            "prompt_ids": self._ids, "response_ids": self._ids, "logprobs": self._logprobs, "loss_mask": None,
            "reward": float(sample % 2), "reward_components": {}, "finish_reason": "stop",
            "timings": {"generate": self.service_s}, "metadata": {"attempt_lease": lease["lease_id"]},
        } for sample in range(self.group_size)]
        return {"epoch": epoch, "prompt_index": index, "rollouts": rollouts}


def _ignore(frames: object) -> None:
    pass
