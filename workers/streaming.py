"""The streaming worker loop (``worker.streaming: true``): continuous batching, each group sent the moment it is done.

::

    pool ══LEASES══► sender I/O thread ──take_leases(free slots, no wait)──► main thread ──submit──► engine batch
    pool ◄═GROUP/FAILED═ sender I/O thread ◄──send_group── reward ◄── poll(≤ POLL_S): the requests that finished
    broadcaster ══► receiver I/O thread: stage + verify ──► main thread, between two polls:
                    engine.apply_weights with requests in flight (keep: they continue under the new weights;
                    abort: they come back aborted and are submitted again)

The main thread blocks only in :meth:`~workers.engines.base.Engine.poll` (at most ``POLL_S``, less while a slot is
free and a lease may arrive), in reward functions (:meth:`asyncrl.rewards.RewardSet.score` on the groups one poll
finished, async ones concurrently), in ``engine.apply_weights`` (the in-flight pause, timed: status
``inflight_pause_p50_s``/``_p99_s``) and, with nothing in flight and nothing to admit, in ``take_leases`` (0.5 s).
It never waits for one request to finish another: up to ``worker.slots`` leases' requests are inside the engine
at once; a slot freed by a finished group is refilled with the next lease at once (the pool grants a streaming
worker every free credit, not in halves: ``streaming`` in HELLO). How full the slots are is in the status:
``leases_held_s`` integrates the leases held (in the engine or waiting for weights) over time, so its growth over
the growth of ``uptime_s`` is the mean number held; below ``slots`` the pool did not grant more (its ``capacity``,
or the staleness window: ``(max_staleness + 1) x batch_size`` groups leased or buffered per trainer rank). ``poll_s``
is the time in ``engine.poll``, and with an engine that splits its free rows (HF: ``idle_empty_seq_s``) the loop
says why rows were free with nothing queued: ``idle_slots_full_seq_s`` (all ``slots`` leases inside),
``idle_no_lease_seq_s`` (fewer: the pool granted no more), the rest accrued outside ``poll``.

Version fencing is the engine's: every token carries the version of the weights that produced it
(``Completion.version_spans``), a rollout's ``policy_version`` is its oldest token's, and the pool judges
staleness from it as for the static loop. One timeline: a group whose request was submitted under another
trainer incarnation than the engine holds when it finishes is not sent; it is submitted again (counted
``groups_resubmitted``), as is every aborted one (each abort: one resubmission, never two copies in flight).
A lease granted at a version or incarnation the engine does not hold waits, without holding up the requests in
flight, until the receiver stages it or ``weights.catch_up_s`` passes, then is submitted. Failures stay per
lease: ``Finished.error`` and a reward function's :class:`~asyncrl.rewards.RewardError` fail only their lease
(FAILED with the text). Heartbeats are the sender's I/O thread's; SHUTDOWN from every pool, a dead parent or a
lost pool end the loop like the static one's (what is in flight is dropped: the pool re-issues its leases).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

from asyncrl.rewards.reward_set import RewardError
from asyncrl.transport import ReceivedLease
from workers.context import WorkerContext
from workers.engines.base import Completion, Finished, GenerationRequest

__all__ = ["POLL_S", "StreamingLoop"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""Longest engine poll while every slot is taken (weights and SHUTDOWN are looked at between polls)."""
ADMIT_POLL_S = 0.01
"""Engine poll while a slot is free: a lease the pool grants meanwhile waits at most this long to be submitted."""
REPORT_S = 0.25
"""How often the worker status (heartbeats) is refreshed while streaming."""


@dataclass(slots=True)
class _InFlight:
    lease: ReceivedLease
    incarnation: str
    """The trainer incarnation whose weights the engine held when the request was submitted."""
    submitted: float


class StreamingLoop:
    """Serves a worker's leases through a streaming engine until SHUTDOWN (see the module docstring).

    Args:
        worker: the worker whose engine (``engine.streaming``), sender, weights, rewards and counters it uses
            (:class:`~workers.context.WorkerContext`).
        slots: most leases whose requests are inside the engine at once (``worker.slots``).
    """

    def __init__(self, worker: WorkerContext, slots: int):
        if not worker.engine.streaming:
            raise ValueError(f"worker.streaming needs an engine that streams; {type(worker.engine).__name__} does not "
                             "(set worker.streaming: false)")
        if worker.environment is not None:
            raise ValueError("worker.streaming does not combine with a multi-turn environment (the static loop runs "
                             "episodes turn by turn)")
        self.w = worker
        self.slots = slots
        self.in_flight: dict[int, _InFlight] = {}
        self.waiting: list[tuple[ReceivedLease, float]] = []
        """Leases waiting for weights of their version/incarnation (deadline: ``catch_up_s`` after arrival)."""
        self._keys = itertools.count()
        self._last_report = 0.0
        self.leases_held_s = 0.0
        """Leases held (in flight or waiting) integrated over time: status ``leases_held_s``."""
        self.poll_s = 0.0
        """Seconds in ``engine.poll`` (status ``poll_s``): ``busy_s - poll_s`` is the time the main thread held an
        engine with work outside it (rewards, sends, weights, admissions), when an engine without its own thread
        does not decode."""
        self.idle_seq_s = {"no_lease": 0.0, "slots_full": 0.0}
        """Engine rows free with nothing queued during a poll (the engine's ``idle_empty_seq_s`` grown over it), by
        the worker's state in it: ``slots_full`` (all ``slots`` leases in the engine: too few slots for the width)
        or ``no_lease`` (fewer: the pool granted no more, i.e. the staleness window, ``capacity`` or a trainer that
        lets the buffer fill). The rest of ``idle_empty_seq_s`` accrued outside ``poll`` (the worker's own time)."""

    def run(self) -> None:
        w = self.w
        while not w.sender.done:
            if w.parent_pid is not None and os.getppid() != w.parent_pid:
                logger.warning("worker %s: parent %d is gone; exiting with %d groups in flight", w.worker_id,
                               w.parent_pid, len(self.in_flight))
                return
            busy = bool(self.in_flight)
            t0 = time.perf_counter()
            self._apply_staged()
            free = self.slots - len(self.in_flight) - len(self.waiting)
            idle = not self.in_flight and not self.waiting
            leases = w.sender.take_leases(max(free, 0), timeout=0.5 if idle else 0.0)
            for lease in leases:
                self._admit(lease)
            self._submit_waiting()
            if self.in_flight and w.engine.in_flight():
                self._finished(self._poll(ADMIT_POLL_S if free > 0 else POLL_S))
            elif self.in_flight:  # the engine holds none of them: an engine bug; never spin, never lose a lease
                self._lost()
            elif self.waiting:
                time.sleep(ADMIT_POLL_S)  # nothing decoding: only weights for a waiting lease can change things
            dt = time.perf_counter() - t0
            self.leases_held_s += (len(self.in_flight) + len(self.waiting)) * dt
            if busy:
                w.busy_s += dt
            if time.perf_counter() - self._last_report > REPORT_S:
                self._last_report = time.perf_counter()
                w.report()

    def _poll(self, timeout: float) -> list[Finished]:
        e = self.w.engine
        before = e.occupancy().get("idle_empty_seq_s")
        t0 = time.perf_counter()
        finished = e.poll(timeout)
        self.poll_s += time.perf_counter() - t0
        if before is not None:
            cause = "slots_full" if len(self.in_flight) >= self.slots else "no_lease"
            self.idle_seq_s[cause] += e.occupancy()["idle_empty_seq_s"] - before
        return finished

    def status(self, occupancy: dict[str, float]) -> dict[str, float]:
        """The loop's worker-status keys (with the engine's idle/pause split of ``occupancy``, where it has one)."""
        out = {"leases_held_s": round(self.leases_held_s, 4),  # mean held: its growth / uptime_s's
               "poll_s": round(self.poll_s, 4)}
        if "idle_empty_seq_s" in occupancy:
            out |= {f"idle_{k}_seq_s": round(v, 4) for k, v in self.idle_seq_s.items()}
            out |= {k: round(occupancy[k], 4) for k in ("idle_queued_seq_s", "idle_empty_seq_s", "pause_seq_s")}
        return out

    # -- admission -------------------------------------------------------------------------------------------

    def _needs_weights(self, lease: ReceivedLease) -> bool:
        e = self.w.engine
        return self.w.weights is not None and not e.follows_pool_version and (
            lease.policy_version > e.policy_version
            or bool(lease.incarnation and e.incarnation and lease.incarnation != e.incarnation))

    def _admit(self, lease: ReceivedLease) -> None:
        e = self.w.engine
        if e.follows_pool_version:  # no weights: adopt the pool's version (in flight, like an update)
            live = lease.incarnation
            if lease.policy_version > e.policy_version or (live and live != e.incarnation):
                e.set_policy_version(lease.policy_version)
                e.incarnation = live
        if self._needs_weights(lease):
            self.waiting.append((lease, time.monotonic() + self.w.catch_up_s))
        else:
            self._submit(lease)

    def _submit_waiting(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        still = []
        for lease, deadline in self.waiting:
            if self._needs_weights(lease) and now < deadline:
                update = self.w.weights.wait(lease.policy_version, timeout=0.0, incarnation=lease.incarnation or None)
                if update is not None:
                    self.w.apply_staged_weights(update)
            if self._needs_weights(lease) and now < deadline:
                still.append((lease, deadline))
            else:  # caught up, or waited catch_up_s: generate (the pool judges what arrives off its timeline)
                self._submit(lease)
        self.waiting = still

    def _submit(self, lease: ReceivedLease) -> None:
        key = next(self._keys)
        request = GenerationRequest(epoch=lease.epoch, prompt_index=lease.prompt_index, prompt=lease.prompt,
                                    n=lease.group_size)
        self.in_flight[key] = _InFlight(lease, self.w.engine.incarnation, time.perf_counter())
        try:
            self.w.engine.submit(key, request)
        except Exception as e:  # deliberate fault tolerance: this lease fails, the batch goes on
            del self.in_flight[key]
            self.w.lease_failed(lease, e, "engine")

    def _apply_staged(self) -> None:
        """Between two polls: the newest staged update, with requests in flight (the worker times the pause)."""
        if self.w.weights is not None:
            update = self.w.weights.poll()
            if update is not None:
                self.w.apply_staged_weights(update)

    def _lost(self) -> None:
        w = self.w
        w.throttle.error("requests_lost", "worker %s: the engine holds none of the %d requests submitted and not "
                          "returned (Engine.in_flight() == 0); submitting them again", w.worker_id, len(self.in_flight))
        entries, self.in_flight = list(self.in_flight.values()), {}
        for entry in entries:
            w.groups_resubmitted += 1
            self._submit(entry.lease)
        time.sleep(ADMIT_POLL_S)

    # -- completion ------------------------------------------------------------------------------------------

    def _finished(self, finished: list[Finished]) -> None:
        done: list[tuple[_InFlight, list[Completion]]] = []
        for f in finished:
            entry = self.in_flight.pop(f.key, None)
            if entry is None:
                logger.warning("worker %s: engine returned unknown request key %d", self.w.worker_id, f.key)
                continue
            if f.error is not None:
                self.w.lease_failed(entry.lease, f.error, "engine")
            elif f.aborted or entry.incarnation != self.w.engine.incarnation:
                # aborted by an in-flight update, or generated (in part) under another trainer incarnation's
                # weights: nothing of it is sent; the lease is generated again, once per abort
                self.w.groups_resubmitted += 1
                self._submit(entry.lease)
            else:
                done.append((entry, f.completions))
        if done:
            self._send(done)

    def _send(self, done: list[tuple[_InFlight, list[Completion]]]) -> None:
        w = self.w
        t0 = time.perf_counter()
        scores = w.rewards.score([(entry.lease.prompt, cs) for entry, cs in done], decode=w.engine.decode)
        reward_s = (time.perf_counter() - t0) / len(done)
        for (entry, completions), scored in zip(done, scores):
            if isinstance(scored, RewardError):  # this group's reward failed: its lease alone
                w.lease_failed(entry.lease, scored)
                continue
            w.send_group(entry.lease, w.make_group(entry.lease, completions, scored, t0 - entry.submitted, reward_s))
