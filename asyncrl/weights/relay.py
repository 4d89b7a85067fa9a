"""A per-node weight relay: one receiver per node verifies each version, then re-serves it to the node's workers.

::

    trainer: ZmqWeightBroadcaster ══ zmq (CURVE off loopback) ══► one WeightRelay per node
                                     one copy (or delta) per node     │ upstream: a ZmqWeightReceiver (relay_id):
                                                                      │   stage + verify every bucket (phase 1)
                                                                      ▼
                                                                 forward thread: publish(update, plan=arrival plan)
                                                                      │ into the node-local backend, each bucket held
                                                                      │ to the checksum it was verified against;
                                                                      │ then commit upstream (phase 2 of the relay)
                                                                      ▼
                          workers on the node ◄── shm segments in the relay directory (or CUDA IPC slots on a GPU)

The broadcaster sends one copy (or delta, ``delta=True``) per node instead of one per worker; a node's workers read
the version from shared memory (:class:`~asyncrl.weights.relayed.RelayedWeightReceiver`), verify it against the
trainer's own bucket checksums, apply and commit it as they would from the trainer.

Guarantees, end to end: the relay re-serves only versions its upstream receiver staged (every bucket verified); with
``serve="shm"`` the version is re-served in the bucket plan it arrived in, each bucket hashed as it is copied and
refused if it differs from the trainer's checksum (:func:`~asyncrl.weights._staging.check_filled`), so a worker
verifies the trainer's checksums, not the relay's. A relay that dies mid-transfer leaves nothing staged anywhere: its
upstream transfer was not complete (nothing re-served), or its segment was not complete (workers verify every
bucket against the count the relay marked written, and stop reading when its lock is gone). The workers fall back to
the broadcaster (the direct path) while the relay is down and return once a replacement serves their version.

The directory is the node's rendezvous (:mod:`asyncrl.weights._relay_dir`): a lock held while the relay lives (a
second relay for it is refused), ``relay.json`` saying what it serves (rewritten every ``HEARTBEAT_S``).

Who blocks on what: :meth:`WeightRelay.start` blocks until the directory's lock is held and the broadcaster answered
(``timeout_s``). The forward thread blocks in the upstream receiver's ``wait`` (``HEARTBEAT_S`` slices) and in the
downstream publish (a copy of the version, plus ``slot_wait_s`` at most for a slot a worker still holds). The
upstream receiver's I/O thread owns its DEALER. Nothing here runs on the worker's side.

Security: upstream is an ordinary weight receiver: off loopback the broadcaster needs CURVE and the relay's public key
in its allow-list (``security``: the rollout channel's transport settings, ``server_key``). Downstream is node-local:
a 0700 directory (``shm``) or the CUDA IPC backend's private socket.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Literal

from asyncrl._zmq.io import IOThread
from asyncrl.config import TransportConfig
from asyncrl.weights import _relay_dir as rd
from asyncrl.weights._staging import check_receiver_id
from asyncrl.weights.base import WeightBroadcaster, WeightSyncError, WeightUpdate
from asyncrl.weights.cuda_ipc import CudaIpcWeightBroadcaster
from asyncrl.weights.shm import ShmWeightBroadcaster
from asyncrl.weights.zmq import ZmqWeightReceiver

__all__ = ["WeightRelay"]

logger = logging.getLogger(__name__)

ANY_VERSION = -(2**62)
LOCK_WAIT_S = 5.0
"""How long :meth:`WeightRelay.start` waits for the directory's lock (a worker's probe holds it for a moment)."""


class WeightRelay:
    """Receives every version once from the broadcaster and re-serves it to this node's workers.

    Args:
        upstream: the broadcaster's address (the trainer's ``weights.address``; a ``zmq`` broadcaster).
        directory: this node's relay directory (created 0700 if missing); its workers set ``weights.relay`` to it.
        relay_id: the relay's receiver id at the broadcaster (``committed()`` is keyed by it).
        serve: ``shm`` (segments in ``directory``) or ``cuda_ipc`` (GPU slots; its control socket's address is
            written to ``relay.json``).
        server_key: the broadcaster's CURVE public key, when it uses CURVE.
        security: this relay's CURVE key (``curve_client_secret_key`` / ``curve_client_key_file``).
        delta: ask for deltas against the version this relay last served (``weights.delta`` of the trainer).
        timeout_s: how long :meth:`start` waits for the broadcaster, and a transfer for its next bucket.
        slot_wait_s: how long a re-serve waits for the node's workers to release the slot it reuses.
        device: ``cuda_ipc``: the GPU of the slots.
        memory: ``cuda_ipc``: the device operations (tests pass a file-backed stand-in).
    """

    def __init__(self, upstream: str, directory: str | os.PathLike, *, relay_id: str | None = None,
                 serve: Literal["shm", "cuda_ipc"] = "shm", server_key: str | None = None,
                 security: TransportConfig | None = None, delta: bool = False, timeout_s: float = 30.0,
                 slot_wait_s: float = 1.0, device: str | None = None, memory: Any = None):
        if serve not in ("shm", "cuda_ipc"):
            raise ValueError(f"relay serve={serve!r} must be 'shm' (shared memory) or 'cuda_ipc' (GPU workers)")
        if timeout_s <= 0 or slot_wait_s < 0:
            raise ValueError(f"relay {timeout_s=} must be > 0 and {slot_wait_s=} >= 0")
        self.upstream_address = upstream
        self.directory = Path(directory)
        self.relay_id = check_receiver_id(relay_id or f"relay-{socket.gethostname()}-{os.getpid()}")
        self.serve = serve
        self._receiver_kw = {"server_key": server_key, "security": security, "delta": delta, "timeout_s": timeout_s}
        self._downstream_kw: dict[str, Any] = ({"slot_wait_s": slot_wait_s} if serve == "shm" else
                                               {"slot_wait_s": slot_wait_s, "device": device, "memory": memory})
        self._lock_fd: int | None = None
        self._upstream: ZmqWeightReceiver | None = None
        self._downstream: WeightBroadcaster | None = None
        self._io = IOThread(self, f"asyncrl-relay-{self.relay_id}", context=False)
        self._started = time.time()
        self._served: tuple[int | None, str] = (None, "")
        self._counters: dict[str, float] = {"versions_served": 0, "serve_failures": 0, "bytes_served": 0,
                                            "serve_s": 0.0, "downstream_restarts": 0, "swept_files": 0}
        self._error: BaseException | None = None
        self._last_failure: str | None = None
        self._counter_lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Takes the directory (refused while another relay holds it), sweeps a dead relay's leftovers, connects to
        the broadcaster and starts serving.

        Raises:
            RelayBusy: another live relay serves the directory.
            WeightSyncError: the broadcaster did not answer within ``timeout_s``.
        """
        self._lock_fd = rd.hold(self.directory, LOCK_WAIT_S)
        try:
            swept = rd.sweep(self.directory)
            if swept:
                logger.info("relay %s: removed %d files a dead relay left in %s", self.relay_id, len(swept),
                            self.directory)
            self._counters["swept_files"] = len(swept)
            self._downstream = self._new_downstream()
            self._upstream = ZmqWeightReceiver(self.upstream_address, receiver_id=self.relay_id, **self._receiver_kw)
            self._upstream.start()  # blocks until the broadcaster answers
            self._heartbeat()  # from here on the node's workers read the relay as up
            self._io.start(self._run)
        except BaseException:
            self.close()
            raise
        logger.info("relay %s: serving %s from %s into %s (%s)", self.relay_id, self.directory,
                    self.upstream_address, self.address, self.serve)

    @property
    def address(self) -> str:
        """Where the node's workers read versions (the directory for ``shm``, an ``ipc://`` endpoint for ``cuda_ipc``)."""
        return self._downstream.address if self._downstream is not None else str(self.directory)

    @property
    def alive(self) -> bool:
        """False once the forward thread died (:attr:`error` says why): the process should exit and be replaced."""
        return self._error is None and self._io.started and not self._io.stop.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def close(self) -> None:
        """Stops serving: the node's workers read the relay as down at once (``relay.json`` first, then the lock)."""
        self._io.close()
        try:
            (self.directory / rd.INFO).unlink(missing_ok=True)
        except OSError:
            pass
        for part in (self._upstream, self._downstream):
            if part is not None:
                part.close()
        self._upstream = self._downstream = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- forward thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._io.stop.is_set():
                update = self._upstream.wait(ANY_VERSION, timeout=rd.HEARTBEAT_S)  # type: ignore[union-attr]
                if update is not None:
                    self._serve(update)
                self._heartbeat()
        except BaseException as e:  # thread boundary: the process sees alive=False and exits to be replaced
            logger.exception("relay %s: forward thread died", self.relay_id)
            self._error = e

    def _serve(self, update: WeightUpdate) -> None:
        """Re-serves one verified version downstream, then commits it upstream; a version that cannot be re-served
        is skipped (counted): the node's workers keep theirs, and the next version is served."""
        last, last_inc = self._served
        if last is not None and update.incarnation != last_inc and update.version <= last:
            # a resumed trainer reuses version numbers: a fresh downstream, whose workers see the new timeline
            self._downstream.close()  # type: ignore[union-attr]
            self._downstream = self._new_downstream()
            self._count("downstream_restarts")
        plan = update.metadata.get("plan") if self.serve == "shm" else None
        t0 = time.perf_counter()
        try:
            self._downstream.publish(update.tensors, update.version, mode=update.mode,  # type: ignore[union-attr]
                                     lora_config=update.lora_config, incarnation=update.incarnation, plan=plan)
        except (WeightSyncError, ValueError) as e:  # deliberate: one bad version must not stop the node's updates
            self._count("serve_failures")
            self._last_failure = f"version {update.version}: {e}"[:500]
            logger.error("relay %s: version %d not re-served: %s", self.relay_id, update.version, e)
            self._upstream.adopt(update.version, update.incarnation)  # type: ignore[union-attr]  # not fetched again
            return
        self._upstream.commit(update.version)  # type: ignore[union-attr]
        self._served = (update.version, update.incarnation)
        with self._counter_lock:
            self._counters["versions_served"] += 1
            self._counters["bytes_served"] += update.nbytes
            self._counters["serve_s"] += time.perf_counter() - t0

    def _new_downstream(self) -> WeightBroadcaster:
        if self.serve == "shm":
            return ShmWeightBroadcaster(self.directory, **self._downstream_kw)
        return CudaIpcWeightBroadcaster(**self._downstream_kw)

    def _heartbeat(self) -> None:
        version, incarnation = self._served
        rd.write_info(self.directory, {"relay_id": self.relay_id, "pid": os.getpid(), "serve": self.serve,
                                       "address": self.address, "upstream": self.upstream_address,
                                       "version": version, "incarnation": incarnation, "started": self._started})

    def _count(self, key: str, n: float = 1) -> None:
        with self._counter_lock:
            self._counters[key] += n

    # -- status --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters (versions and bytes re-served, failures), the version served, and both ends' own stats."""
        with self._counter_lock:
            out: dict[str, Any] = dict(self._counters)
        out.update(relay_id=self.relay_id, directory=str(self.directory), serve=self.serve,
                   served_version=self._served[0], served_incarnation=self._served[1], last_failure=self._last_failure,
                   error=None if self._error is None else repr(self._error))
        out["upstream"] = self._upstream.stats() if self._upstream is not None else None
        out["downstream"] = self._downstream.stats() if self._downstream is not None else None  # type: ignore[attr-defined]
        return out
