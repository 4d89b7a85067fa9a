"""The worker end behind a node's relay: versions from the relay, from the broadcaster while the relay is down.

::

    relay (this node, asyncrl.weights.relay) ──shm | cuda_ipc──► relay receiver ──┐
                                                                                     ├─► poll / wait / commit
    broadcaster (the trainer) ────────────────────zmq──────────► direct receiver ──┘    (the worker's thread)

    path:  relay ──(relay down)──► direct ──(a relay up again)──► both ──(it serves the worker's version)──► relay

A worker whose ``weights.relay`` names its node's relay directory reads every version from the relay (one copy per
node leaves the trainer). When the relay is down (its lock is free: it died; or its heartbeat is stale: it hangs) the
worker connects to the broadcaster itself (the direct path, a ``zmq`` receiver) and goes on receiving; when a relay
(the replacement) is up again, both run until the relay serves the version the worker holds or a newer one, then
the direct receiver is closed. A version is taken from whichever receiver staged the newest; it is committed to
that receiver and *adopted* by the other (:meth:`~asyncrl.weights._receiver.StagedReceiver.adopt`), so neither
fetches or offers it again.

Two-phase commit holds per path: each receiver stages only versions whose every bucket it verified (a relay's
segment against the trainer's own bucket checksums, :mod:`asyncrl.weights.relay`). A relay that dies mid-transfer
leaves its receiver's transfer incomplete: the receiver is closed on the next look (its transfer is dropped, nothing
staged), and the worker keeps its version until the direct path or a replacement brings the next one. An update
already handed to the engine stays valid: the receiver it came from is closed only after the engine committed it.

Who blocks on what: the worker's thread blocks only in :meth:`RelayedWeightReceiver.wait`, on this receiver's
condition (notified by either receiver's staging and by path changes). A watch thread looks at the relay every
``CHECK_S`` (a lock probe and a stat: :func:`asyncrl.weights._relay_dir.look`) and opens or closes the receivers;
the direct one is opened without waiting for the broadcaster's answer (except at start-up, in :meth:`start`).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl._zmq.io import IOThread
from asyncrl.weights import _relay_dir as rd
from asyncrl.weights._receiver import StagedReceiver
from asyncrl.weights._staging import check_receiver_id
from asyncrl.weights.base import WeightReceiver, WeightSyncError, WeightUpdate
from asyncrl.weights.cuda_ipc import CudaIpcWeightReceiver
from asyncrl.weights.shm import ShmWeightReceiver

__all__ = ["CHECK_S", "RelayedWeightReceiver"]

logger = logging.getLogger(__name__)

CHECK_S = 0.05
"""How often the watch thread looks at the relay (a lock probe and a stat)."""
RETRY_S = 1.0
"""After a receiver failed to open (the broadcaster did not answer), the next attempt waits this long."""
_SUMMED = ("failures", "versions_staged", "abandoned", "checksum_mismatches", "bytes_received", "full_bytes",
           "delta_bytes", "buckets_full", "buckets_delta")
"""Counters summed over every receiver this worker has had (open ones and closed ones)."""


class RelayedWeightReceiver(WeightReceiver):
    """A worker's receiver behind its node's relay, with the broadcaster as the fallback.

    Args:
        relay: the node's relay directory (``asyncrl relay --serve-shm DIR``; ``weights.relay``).
        receiver_id: unique name of this worker (names its commit record in the relay directory, and its receiver at
            the broadcaster on the direct path).
        direct: makes the direct path's receiver (not started), e.g. a ``ZmqWeightReceiver`` of the broadcaster's
            address; None: no fallback (the worker waits for a relay).
        relay_kw: extra arguments of the relay-side receiver (``cuda_ipc``: ``device``, ``memory``).
        stale_s: a relay whose heartbeat is older than this is taken as down.
    """

    def __init__(self, relay: str | os.PathLike, *, receiver_id: str,
                 direct: Callable[[], StagedReceiver] | None = None, relay_kw: dict[str, Any] | None = None,
                 stale_s: float = rd.STALE_S):
        self.relay = Path(relay)
        self.receiver_id = check_receiver_id(receiver_id)
        self.address = str(self.relay)
        self._make_direct = direct
        self._relay_kw = dict(relay_kw or {})
        self._stale_s = stale_s
        self._cv = threading.Condition()
        self._primary: StagedReceiver | None = None
        self._primary_of: tuple[Any, ...] | None = None
        """The relay (:attr:`~asyncrl.weights._relay_dir.RelayView.identity`) the primary receiver reads."""
        self._direct: StagedReceiver | None = None
        self._draining: list[StagedReceiver] = []
        """Receivers taken out of use whose update the engine may still be reading: closed after the next commit."""
        self._handed: tuple[WeightUpdate, StagedReceiver] | None = None
        self._committed: tuple[int, str] | None = None
        self._closed = False
        self._shadow: Any = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._retired: collections.Counter[str] = collections.Counter()
        self._failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=8)
        self._retry_direct_at = 0.0
        self._kind: dict[int, str] = {}
        """``relay`` or ``direct`` for each open receiver, by ``id``."""
        self._down_reason = ""
        self._io = IOThread(self, f"asyncrl-relay-watch-{self.receiver_id}", context=False)

    # -- the worker's thread -------------------------------------------------------------------
    def attach_shadow(self, shadow: Any) -> None:
        """Gives ``shadow`` (the engine's shadow weights, ``weights.shadow``) to every ``shm`` relay receiver this
        worker opens. Call before :meth:`start`."""
        if self._io.started:
            raise ValueError(f"receiver {self.receiver_id}: attach_shadow() after start()")
        self._shadow = shadow

    def start(self) -> None:
        """Opens the relay receiver, or the direct one if the relay is down, then starts watching the relay.

        Raises:
            WeightSyncError: the relay is down and the broadcaster did not answer (the direct receiver's ``timeout_s``).
        """
        if self._io.started:
            return
        self._watch_once(time.monotonic(), first=True)
        self._io.start(self._run)

    def poll(self) -> WeightUpdate | None:
        with self._cv:
            return self._take(None, None)

    def wait(self, version: int, timeout: float, *, incarnation: str | None = None) -> WeightUpdate | None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while (update := self._take(version, incarnation)) is None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cv.wait(remaining)
            return update

    def commit(self, version: int) -> None:
        """Commits ``version`` to the receiver it came from; the other one adopts it.

        Raises:
            ValueError: ``version`` is not the one last handed out.
        """
        with self._cv:
            if self._handed is None or self._handed[0].version != version:
                handed = None if self._handed is None else self._handed[0].version
                raise ValueError(f"receiver {self.receiver_id}: commit({version}) of a version not handed out "
                                 f"(last handed: {handed})")
            update, source = self._handed
            source.commit(version)
            for other in (self._primary, self._direct, *self._draining):
                if other is not None and other is not source:
                    other.adopt(version, update.incarnation)
            self._committed = (version, update.incarnation)
            self._handed = None
            self._counters["versions_committed"] += 1
            self._counters[f"versions_via_{self._kind.get(id(source), 'relay')}"] += 1
            draining, self._draining = self._draining, []
        for r in draining:
            self._close_receiver(r)

    @property
    def committed_version(self) -> int | None:
        with self._cv:
            return None if self._committed is None else self._committed[0]

    @property
    def path(self) -> str:
        """``relay``, ``direct``, ``both`` (the relay is catching up) or ``none`` (relay down, no fallback)."""
        with self._cv:
            return _path(self._primary, self._direct)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            receivers = [(self._kind.get(id(r), "relay"), r) for r in (self._primary, self._direct) if r is not None]
            committed = self._committed
            out: dict[str, Any] = {"receiver_id": self.receiver_id, "address": self.address,
                                   "path": _path(self._primary, self._direct), "relay_down_reason": self._down_reason}
            out.update({k: 0 for k in ("versions_committed", "versions_via_relay", "versions_via_direct",
                                       "relay_fallbacks", "relay_returns", "relay_opens")})
            out.update(self._counters)
            summed = collections.Counter(self._retired)
            failures = list(self._failures)
        inner = {}
        for kind, r in receivers:
            s = r.stats()
            inner[kind] = s
            for k in _SUMMED:
                if isinstance(s.get(k), (int, float)):
                    summed[k] += s[k]
            failures += s.get("recent_failures", [])
        out.update({k: summed.get(k, 0) for k in ("failures", "versions_staged", "abandoned")})
        if summed.get("full_bytes") or summed.get("delta_bytes"):  # bytes pulled from the broadcaster directly
            out.update(full_bytes=summed["full_bytes"], delta_bytes=summed["delta_bytes"])
        out["bytes_received"] = summed.get("bytes_received", 0)
        out["committed_version"], out["committed_incarnation"] = committed if committed else (None, "")
        out["recent_failures"] = sorted(failures, key=lambda f: f.get("time", 0))[-8:]
        out["error"] = None
        if "relay" in inner and isinstance(inner["relay"].get("shadow"), dict):
            out["shadow"] = inner["relay"]["shadow"]
            for k in ("shadow_busy", "shadow_mismatch", "versions_via_shadow"):
                out[k] = inner["relay"].get(k, 0)
        out.update(inner)
        return out

    def close(self) -> None:
        self._io.close()
        with self._cv:
            self._closed = True
            receivers = [r for r in (self._primary, self._direct, *self._draining) if r is not None]
            self._primary = self._direct = None
            self._draining = []
            self._handed = None
            self._cv.notify_all()
        for r in receivers:
            self._close_receiver(r)

    # -- picking an update (under self._cv) ------------------------------------------------------
    def _take(self, version: int | None, incarnation: str | None) -> WeightUpdate | None:
        best: tuple[WeightUpdate, StagedReceiver] | None = None
        for r in (self._primary, self._direct):
            if r is None:
                continue
            try:
                u = r.wait(version if version is not None else -(2**62), 0.0, incarnation=incarnation)
            except WeightSyncError as e:  # that receiver's I/O thread died: the watch thread replaces it
                self._note_failure(None, f"receiver {'relay' if r is self._primary else 'direct'} died: {e}")
                continue
            if u is None or not self._newer(u):
                continue
            if best is None or self._better(u, r, best):
                best = (u, r)
        if best is None:
            return None
        self._handed = best
        return best[0]

    def _newer(self, u: WeightUpdate) -> bool:
        c = self._committed
        return c is None or u.incarnation != c[1] or u.version > c[0]

    def _better(self, u: WeightUpdate, r: StagedReceiver, best: tuple[WeightUpdate, StagedReceiver]) -> bool:
        """Whether ``u`` (from ``r``) beats ``best``: the newer version of one incarnation (the relay's on a tie);
        across incarnations, the one that is not the committed timeline, else the direct path's (the trainer's)."""
        b = best[0]
        if u.incarnation == b.incarnation:
            return u.version > b.version
        live = None if self._committed is None else self._committed[1]
        if (b.incarnation == live) != (u.incarnation == live):
            return b.incarnation == live
        return r is self._direct

    # -- the watch thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._io.stop.wait(CHECK_S):
            try:
                self._watch_once(time.monotonic())
            except Exception:  # thread boundary, deliberate: a failed look is retried on the next tick
                logger.exception("receiver %s: watching relay %s failed", self.receiver_id, self.relay)

    def _watch_once(self, now: float, first: bool = False) -> None:
        view = rd.look(self.relay, self._stale_s)
        with self._cv:
            primary, primary_of, direct = self._primary, self._primary_of, self._direct
        if view.up:
            if primary is None or primary_of != view.identity:
                if primary is not None:  # a replacement relay (or it re-created what it serves)
                    self._retire(primary, "the relay was replaced")
                self._open_primary(view)
            if direct is not None and self._caught_up(view):
                self._retire(direct, "the relay serves this worker's version")
                self._count("relay_returns")
                logger.info("receiver %s: back on relay %s (version %s)", self.receiver_id, self.relay, view.served[0])
            return
        if primary is not None:
            self._retire(primary, view.reason)
        if direct is None and self._make_direct is not None and now >= self._retry_direct_at:
            self._down_reason = view.reason
            if not first:
                logger.warning("receiver %s: relay %s is down (%s); receiving from the broadcaster directly meanwhile",
                               self.receiver_id, self.relay, view.reason)
            self._count("relay_fallbacks")
            self._open_direct(now, raise_errors=first)

    def _open_primary(self, view: rd.RelayView) -> None:
        info = view.info or {}
        if info.get("serve") == "cuda_ipc":
            r: StagedReceiver = CudaIpcWeightReceiver(str(info.get("address")), receiver_id=self.receiver_id,
                                                      **self._relay_kw)
        else:
            r = ShmWeightReceiver(self.relay, receiver_id=self.receiver_id)
            if self._shadow is not None:
                r.attach_shadow(self._shadow)
        self._prepare(r)
        try:
            r.start()
        except WeightSyncError as e:  # a relay that went away while it was opened: looked at again next tick
            self._note_failure(None, f"opening the relay's receiver: {e}")
            r.close()
            return
        self._register(r, "relay", view.identity)

    def _open_direct(self, now: float, raise_errors: bool) -> None:
        r = self._make_direct()  # type: ignore[misc]
        self._prepare(r)
        try:  # at start-up, a broadcaster that does not answer is an error; later, the fallback never blocks the watch
            r.start(wait=raise_errors)
        except WeightSyncError as e:
            r.close()
            if raise_errors:
                raise
            self._note_failure(None, f"opening the direct path: {e}")
            self._retry_direct_at = now + RETRY_S
            return
        self._register(r, "direct")

    def _register(self, r: StagedReceiver, kind: str, relay: tuple[Any, ...] | None = None) -> None:
        with self._cv:
            closed, committed = self._closed, self._committed
            if not closed:  # else: closed while it was being opened (a start blocks); nobody will use it
                if kind == "relay":
                    self._primary, self._primary_of = r, relay
                    self._counters["relay_opens"] += 1
                else:
                    self._direct = r
                self._kind[id(r)] = kind
                self._cv.notify_all()
        if closed:
            r.close()
        elif committed is not None:  # a commit between _prepare and now: it holds nothing older either
            r.adopt(*committed)

    def _prepare(self, r: StagedReceiver) -> None:
        """A new receiver starts from what the engine runs, and wakes :meth:`wait` whenever it stages a version."""
        with self._cv:
            committed = self._committed
        if committed is not None:
            r.adopt(*committed)
        r.listen(self._staged)

    def _staged(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _caught_up(self, view: rd.RelayView) -> bool:
        """Whether the relay serves what the direct path brought (the worker's version, or a newer staged one)."""
        served, served_inc = view.served
        if served is None:
            return False
        with self._cv:
            target = self._committed
            d = self._direct
        if d is not None:  # a version the direct path staged but the engine has not applied yet
            newest, newest_inc = d.newest()
            if newest is not None and (target is None or newest > target[0] or newest_inc != target[1]):
                target = (newest, newest_inc)
        return target is None or (served_inc == target[1] and served >= target[0])

    def _retire(self, r: StagedReceiver, reason: str) -> None:
        """Takes ``r`` out of use: closed now, or after the next commit if the engine may be reading its update."""
        with self._cv:
            if r is self._primary:
                self._primary, self._primary_of = None, None
            elif r is self._direct:
                self._direct = None
            else:
                return
            handed = self._handed is not None and self._handed[1] is r
            if handed:
                self._draining.append(r)
            self._cv.notify_all()
        logger.info("receiver %s: closing its %s receiver (%s)", self.receiver_id, self._kind.get(id(r)), reason)
        if not handed:
            self._close_receiver(r)

    def _close_receiver(self, r: StagedReceiver) -> None:
        stats = r.stats()
        r.close()
        with self._cv:
            self._kind.pop(id(r), None)
            for k in _SUMMED:
                if isinstance(stats.get(k), (int, float)):
                    self._retired[k] += stats[k]
            self._failures.extend(stats.get("recent_failures", []))

    def _note_failure(self, version: int | None, reason: str) -> None:
        with self._cv:  # counted by the receivers themselves; this records why the path changed
            self._failures.append({"version": version, "reason": reason[:500], "time": time.time()})
        logger.warning("receiver %s: %s", self.receiver_id, reason)

    def _count(self, key: str) -> None:
        with self._cv:
            self._counters[key] += 1


def _path(primary: StagedReceiver | None, direct: StagedReceiver | None) -> str:
    if primary is not None and direct is not None:
        return "both"
    return "relay" if primary is not None else "direct" if direct is not None else "none"
