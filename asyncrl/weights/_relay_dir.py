"""A node's relay directory: where one weight relay and the workers on its node meet (private).

::

    {dir}/relay.lock     flock'ed exclusively by the live relay for as long as it serves: the kernel drops the lock
                         the moment the relay dies, however it dies, so "is the relay alive" is a lock probe
    {dir}/relay.json     {format, relay_id, pid, serve, address, upstream, version, incarnation, started, heartbeat}:
                         what it serves and where (replaced atomically; rewritten every HEARTBEAT_S and after each
                         version it serves)
    {dir}/latest.json, *.seg, committed-*.json   the ``shm`` backend's files (``serve: shm``)

A relay holds the lock before it writes anything, so a second relay for the same directory is refused (naming the
first) instead of interleaving segments; a replacement takes the lock its dead predecessor released and sweeps the
segments it left behind. A worker reads the relay as up when the lock is held, ``relay.json`` is there and its
heartbeat is younger than ``STALE_S`` (a stopped or hung relay keeps its lock).

Who blocks on what: :func:`hold` polls the lock for at most its timeout; everything else is non-blocking.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from asyncrl.weights.shm import LATEST, _lock, _write_atomic

__all__ = ["FORMAT", "HEARTBEAT_S", "INFO", "LOCK", "STALE_S", "RelayBusy", "RelayView", "hold", "look", "sweep",
           "write_info"]

LOCK = "relay.lock"
INFO = "relay.json"
FORMAT = 1
HEARTBEAT_S = 1.0
"""A serving relay rewrites ``relay.json`` at least this often."""
STALE_S = 15.0
"""A relay whose ``relay.json`` is older than this is taken as hung: its workers use the direct path."""


class RelayBusy(RuntimeError):
    """Another live relay holds the directory."""


def hold(directory: Path, timeout: float) -> int:
    """Creates ``directory`` (0700) if missing and takes its relay lock; returns the lock's descriptor (close it to
    release the lock).

    Raises:
        RelayBusy: another relay held the lock for all of ``timeout`` seconds (named from its ``relay.json``).
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    if _lock(fd, fcntl.LOCK_EX, timeout):  # polled: a worker's probe holds it shared for a moment
        return fd
    os.close(fd)
    info = read_info(directory) or {}
    raise RelayBusy(f"another relay serves {str(directory)!r} (relay_id={info.get('relay_id')!r}, "
                    f"pid={info.get('pid')!r}); stop it, or give this one another directory")


def sweep(directory: Path) -> list[str]:
    """Removes what a dead relay left in ``directory`` (its ``relay.json``, segments and ``latest.json``; workers' commit
    records stay). Call holding the lock. Returns the names removed."""
    removed = []
    for path in [directory / INFO, *directory.glob("*.seg"), directory / LATEST, *directory.glob(f".{LATEST}.tmp*"),
                 *directory.glob(f".{INFO}.tmp*")]:
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def write_info(directory: Path, info: dict[str, Any]) -> None:
    _write_atomic(directory / INFO, orjson.dumps({"format": FORMAT, **info, "heartbeat": time.time()}))


def read_info(directory: Path) -> dict[str, Any] | None:
    """``relay.json``, or None if it is missing or not a relay's (a relay is writing it: the next look sees it)."""
    try:
        info = orjson.loads((directory / INFO).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return info if isinstance(info, dict) and info.get("format") == FORMAT else None


def _locked(directory: Path) -> bool:
    """Whether a live process holds the relay lock (a shared probe that fails; it is released at once otherwise)."""
    try:
        fd = os.open(directory / LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the probe's lock, if it got it
    return False


@dataclass(frozen=True, slots=True)
class RelayView:
    """What a worker sees of its node's relay at one look."""

    up: bool
    reason: str
    """Why it is down (for the log), or ``"up"``."""
    info: dict[str, Any] | None = None

    @property
    def identity(self) -> tuple[Any, ...]:
        """Which relay this is: a replacement, or a relay that re-created its downstream, has another one."""
        i = self.info or {}
        return i.get("relay_id"), i.get("pid"), i.get("started"), i.get("serve"), i.get("address")

    @property
    def served(self) -> tuple[int | None, str]:
        """The newest version it serves and its incarnation (None: nothing yet)."""
        i = self.info or {}
        version = i.get("version")
        return (version if type(version) is int else None), str(i.get("incarnation") or "")


def look(directory: Path, stale_s: float = STALE_S) -> RelayView:
    """The relay of ``directory`` as a worker sees it now (the lock, then ``relay.json`` and its heartbeat)."""
    if not _locked(directory):
        return RelayView(False, "no live relay holds the directory's lock")
    info = read_info(directory)
    if info is None:
        return RelayView(False, f"the relay has not written {INFO} yet")
    age = time.time() - float(info.get("heartbeat") or 0)
    if age > stale_s:
        return RelayView(False, f"the relay's heartbeat is {age:.0f} s old (hung?)", info)
    return RelayView(True, "up", info)
