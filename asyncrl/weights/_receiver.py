"""The worker end that every CPU weight backend shares: staging, failures, the I/O thread (private).

:class:`StagedReceiver` is a :class:`~asyncrl.weights.base.WeightReceiver` whose backend only says how
to move bytes: it implements ``_loop()`` (run by one I/O thread until ``self._stop`` is set) and stages
verified updates with :meth:`StagedReceiver._stage`. Everything the worker's thread calls (``poll``,
``wait``, ``commit``, ``stats``, ``close``) is here, on a :class:`~asyncrl.weights._staging.StagingArea`.

Who blocks on what: the worker's thread blocks only in :meth:`wait` (a condition variable, with a
timeout); the I/O thread blocks only in its backend's poll with a short timeout. A crash of the I/O
thread is re-raised in the worker's thread by the next ``poll``/``wait``.

Shadow weights (:mod:`asyncrl.weights.shadow`): a backend with ``supports_shadow`` fills an attached engine
shadow bucket by bucket during the transfer and stages the update over it; without one attached (or when it is
busy or does not fit the version) it stages views, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from asyncrl._zmq.io import IOThread
from asyncrl.weights._staging import StagingArea, check_receiver_id
from asyncrl.weights.base import WeightReceiver, WeightUpdate

__all__ = ["RETRY_S", "StagedReceiver"]

logger = logging.getLogger("asyncrl.weights")

RETRY_S = 1.0
"""A failed version is fetched again at the earliest this long after the failure."""


class StagedReceiver(WeightReceiver):
    """Base of the shm and zmq receivers (and any backend that stages buckets on the CPU).

    Args:
        address: the broadcaster's address, as the backend understands it.
        receiver_id: unique name of this worker.
        zmq_context: whether the I/O thread needs a ZeroMQ context (``self._ctx``).
    """

    uses_zmq = False
    supports_shadow = False
    """Whether the backend fills an attached :class:`~asyncrl.weights.shadow.ShadowWeights` (:meth:`attach_shadow`)."""

    def __init__(self, address: str, *, receiver_id: str):
        self.address = address
        self.receiver_id = check_receiver_id(receiver_id)
        self._staging = StagingArea(self.receiver_id)
        self._io = IOThread(self, f"asyncrl-weights-{self.receiver_id}", context=self.uses_zmq)
        self._ctx = self._io.ctx
        self._stop = self._io.stop
        self._shadow: Any = None
        """The engine's :class:`~asyncrl.weights.shadow.ShadowWeights`, if attached (read by the I/O thread)."""
        # I/O thread only:
        self._failed_version: int | None = None
        self._retry_after = 0.0

    # -- backend hooks ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """The I/O thread's body: returns once ``self._stop`` is set."""
        raise NotImplementedError

    def _check_start(self) -> None:
        """Raises :class:`~asyncrl.weights.base.WeightSyncError` before the thread starts (a wrong address)."""

    def _wait_started(self) -> None:
        """Blocks until the backend is ready to serve (zmq: the broadcaster's first reply), or raises."""

    def _on_commit(self, version: int) -> None:
        """Reports ``version`` as applied to the broadcaster (phase two)."""

    # -- worker thread -------------------------------------------------------------------------
    def attach_shadow(self, shadow: Any) -> None:
        """Fills ``shadow`` (the engine's :class:`~asyncrl.weights.shadow.ShadowWeights`) with every ``full`` version
        whose tensors match its layout, during the transfer; the staged update's tensors are then the shadow's and
        the engine swaps them in (``weights.shadow``). Call before :meth:`start`.

        Raises:
            ValueError: the backend cannot fill a shadow, or the receiver already started.
        """
        if not self.supports_shadow:
            raise ValueError(f"weights.shadow: the {type(self).__name__} cannot fill an engine's shadow weights; use "
                             "weights.type=shm, or weights.shadow=false")
        if self._io.started:
            raise ValueError(f"receiver {self.receiver_id}: attach_shadow() after start()")
        self._shadow = shadow

    def start(self, *, wait: bool = True) -> None:
        """Starts the I/O thread and (``wait``) blocks until the backend is ready to serve, else raises.

        ``wait=False``: returns at once; a broadcaster that never answers shows only in :meth:`stats` (a receiver
        that must not block its caller, e.g. a relayed worker's fallback opened while the relay is down)."""
        if self._io.started:
            return
        self._check_start()
        self._io.start(self._run)
        if wait:
            self._wait_started()

    def poll(self) -> WeightUpdate | None:
        return self._staging.poll()

    def wait(self, version: int, timeout: float, *, incarnation: str | None = None) -> WeightUpdate | None:
        return self._staging.wait(version, timeout, incarnation)

    def commit(self, version: int) -> None:
        self._staging.commit(version)
        self._on_commit(version)

    def adopt(self, version: int, incarnation: str) -> None:
        """The engine runs ``version`` of ``incarnation``, applied from another receiver (see
        :meth:`~asyncrl.weights._staging.StagingArea.adopt`): nothing older is staged or fetched from here on."""
        self._staging.adopt(version, incarnation)

    def listen(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` after every version this receiver stages (in its I/O thread, no lock held)."""
        self._staging.listen(callback)

    def newest(self) -> tuple[int | None, str]:
        """The newest version staged or committed here and its incarnation (what a transfer must beat)."""
        return self._staging.newest(), self._staging.newest_incarnation()

    @property
    def committed_version(self) -> int | None:
        return self._staging.committed_version

    @property
    def committed_incarnation(self) -> str:
        return self._staging.committed_incarnation

    def stats(self) -> dict[str, Any]:
        out = self._staging.stats()
        out.update(receiver_id=self.receiver_id, address=str(self.address))
        if self._shadow is not None:
            out["shadow"] = self._shadow.stats()
        return out

    def close(self) -> None:
        self._io.close()
        self._staging.close()

    # -- I/O thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # thread boundary: poll()/wait() re-raise it in the worker's thread
            logger.exception("receiver %s: weight I/O thread died", self.receiver_id)
            self._staging.die(e)

    def _stage(self, update: WeightUpdate, release: Callable[[], None] | None = None) -> None:
        self._failed_version = None
        self._staging.stage(update, release)

    def _retry_due(self, version: int, now: float) -> bool:
        """Whether ``version`` may be fetched now: not the one that just failed, or its retry is due."""
        return self._failed_version is None or version > self._failed_version or now >= self._retry_after

    def _fail(self, version: int | None, reason: str, now: float | None = None) -> None:
        """Counts and logs a failed transfer of ``version``; it is retried after ``RETRY_S``."""
        now = time.monotonic() if now is None else now
        self._staging.fail(version, reason)
        self._failed_version, self._retry_after = version, now + RETRY_S
        logger.warning("receiver %s: weight transfer failed (%s); keeping committed version %s, retrying in %.1f s",
                       self.receiver_id, reason, self._staging.committed_version, RETRY_S)
