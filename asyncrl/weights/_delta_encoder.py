"""The zmq broadcaster's delta encoder: encodes bucket deltas in threads of its own (private).

Why a thread of its own: a delta costs a compare pass over the new bucket and its base (~1.2 GB/s a core,
:mod:`asyncrl.weights.delta`), as long as the bucket's whole transfer over loopback. Encoded in the I/O
thread on a GET (as before), it was serial with everything that thread does and began only when a
receiver asked, one receiver round trip after the previous bucket. Here the trainer's publish submits
bucket ``i`` against the previous version as soon as it is written, so the encode of bucket ``i + 1``
overlaps the send and the receiver's decode of bucket ``i``; a GET naming another base submits that
encode. Each ``(version, bucket, base)`` is encoded once, for every receiver at that base.

Who blocks on what: :meth:`DeltaEncoder.submit` never blocks (the trainer thread and the I/O thread call
it); the encoder threads block on the job queue (polling the stop event every ``TICK_S``) and run one
job at a time each; a job reports its own result (the broadcaster stores it and wakes its I/O thread,
which serves the GETs parked for it). A job that raises is logged and counted by the broadcaster's
``on_error``; the thread goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable

from asyncrl._zmq.io import IOThread

__all__ = ["DeltaEncoder"]

logger = logging.getLogger(__name__)

TICK_S = 0.1
"""How often an idle encoder thread looks at the stop event."""


class DeltaEncoder:
    """Runs submitted encode jobs in ``threads`` background threads, each key at most once while pending.

    Args:
        owner: the broadcaster (its garbage collection stops the threads).
        threads: encoder threads (jobs of one version's buckets run in parallel across them).
        on_error: called with the exception of a job that raised (thread boundary).
    """

    def __init__(self, owner: object, *, threads: int = 1, on_error: Callable[[BaseException], None]):
        if threads < 1:
            raise ValueError(f"{threads=} must be >= 1")
        self._on_error = on_error
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Hashable, Callable[[], None]]] = collections.deque()
        self._pending: set[Hashable] = set()
        self._threads = [IOThread(owner, f"asyncrl-delta-encoder-{k}", context=False) for k in range(threads)]
        for t in self._threads:
            t.start(lambda stop=t.stop: self._run(stop))

    def submit(self, key: Hashable, job: Callable[[], None]) -> bool:
        """Queues ``job`` under ``key`` unless a job of that key is pending; returns whether it queued it."""
        with self._cond:
            if key in self._pending:
                return False
            self._pending.add(key)
            self._jobs.append((key, job))
            self._cond.notify()
        return True

    def pending(self, key: Hashable) -> bool:
        """Whether a job of ``key`` is queued or running."""
        with self._cond:
            return key in self._pending

    @property
    def alive(self) -> bool:
        return any(t.thread is not None and t.thread.is_alive() and not t.stop.is_set() for t in self._threads)

    def close(self) -> None:
        """Stops the threads after the jobs they are running (queued ones are dropped) and joins them."""
        for t in self._threads:
            t.stop.set()
        with self._cond:
            self._jobs.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.close()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._cond:
                if not self._jobs:
                    self._cond.wait(TICK_S)
                    continue
                key, job = self._jobs.popleft()
            try:
                job()
            except Exception as e:  # thread boundary: the broadcaster counts it and serves that bucket full
                logger.exception("delta encoder: job %r failed", key)
                try:
                    self._on_error(e)
                except Exception:  # a failing report must not end the thread that serves every later encode
                    logger.exception("delta encoder: on_error failed")
            finally:
                with self._cond:
                    self._pending.discard(key)
