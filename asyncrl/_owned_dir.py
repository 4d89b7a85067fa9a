"""Scratch directories that outlive a SIGKILL only until the next one is made.

A process that makes a scratch directory (the shared-memory weight segments under ``/dev/shm``, the CUDA IPC
broadcaster's socket, the LoRA adapter vLLM loads from) removes it on close or at exit, but a SIGKILL skips
both: on a real model each leaked ``/dev/shm/asyncrl-weights-*`` holds two copies of the weights in RAM, and
tmpfs frees them only at reboot. So each such directory holds an owner lock: ``.owner`` inside it, ``flock``ed
exclusively by the process that made it for as long as the directory is in use. The kernel drops the lock when
that process dies, however it dies (flock locks belong to the open file, so a child forked without ``exec``
keeps it until it dies too; that only delays the sweep). Before it makes a new directory, :func:`make_owned_dir`
sweeps its siblings with the same prefix: one whose ``.owner`` it can lock has a dead owner and is removed.

A directory is built under a hidden name and renamed into place once its lock is held, so every directory
visible under the prefix is locked from its first moment and a sweep never races its maker. It is removed the
other way round, by its owner or by a sweep that holds its lock: renamed to a hidden name first, then emptied,
``.owner`` last. So a kill at any moment of making or removing leaves either a visible directory with an
``.owner`` whose lock is free (swept by the next maker) or a hidden ``.{prefix}*`` one. A half-made one
(``.{prefix}new-*``) is swept once it is older than :data:`UNLOCKED_GRACE_S` (younger, its maker may be between
creating ``.owner`` and locking it) and its lock is free, or it has no ``.owner`` and no process of this user has a
file in it open or mapped; a half-removed one (``.{prefix}gone-*``) at once on the same terms.

A directory under the prefix without ``.owner`` was made by an asyncrl older than this module, or emptied by one
whose removal started with ``.owner``: it is removed once it is older than the grace period and no process of
this user has a file in it open or mapped (``/proc``; without ``/proc`` it is never removed), else named in a
warning with its size and left alone. Only the process that made a directory removes it on close: a child forked
without ``exec`` that closes its copy (a finalizer at its exit) releases its descriptor and nothing else.

Who blocks on what: nothing; every lock attempt is non-blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OwnedDir", "Swept", "make_owned_dir", "sweep_dead"]

logger = logging.getLogger(__name__)

OWNER = ".owner"
UNLOCKED_GRACE_S = 60.0
"""A hidden half-made directory older than this, its lock free or missing, is a maker's crash leftover."""


@dataclass(frozen=True, slots=True)
class Swept:
    """What one sweep removed (``removed``: paths and bytes) and left alone (``legacy``: without an owner lock, and
    in use or younger than the grace period)."""

    removed: tuple[tuple[str, int], ...] = ()
    legacy: tuple[tuple[str, int], ...] = ()

    @property
    def removed_bytes(self) -> int:
        return sum(n for _, n in self.removed)


class OwnedDir:
    """A scratch directory and the owner lock that marks it in use; :meth:`close` removes both."""

    def __init__(self, path: Path, fd: int, prefix: str):
        self.path, self._fd, self._prefix, self._pid = path, fd, prefix, os.getpid()

    def close(self) -> None:
        """Removes the directory (hidden first, ``.owner`` last), then releases the lock (idempotent). In a forked
        child it only closes the child's copy of the lock's descriptor: the directory is its parent's."""
        if self._fd is None:
            return
        if os.getpid() == self._pid:
            _remove(self.path, self._prefix)
        os.close(self._fd)  # the lock goes with the last descriptor of the file
        self._fd = None


def _remove(path: Path, prefix: str) -> None:
    """Removes ``path`` so that a kill at any moment leaves no visible directory without ``.owner``: renamed to a
    hidden name first, then emptied, ``.owner`` last. The caller holds its lock (or it has no ``.owner``)."""
    if not path.name.startswith("."):
        hidden = path.with_name(f".{prefix}gone-{secrets.token_hex(4)}")
        try:
            os.rename(path, hidden)
            path = hidden
        except OSError:
            return  # gone already
    for entry in list(os.scandir(path)) if path.is_dir() else ():
        if entry.name == OWNER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.unlink(path / OWNER)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512  # what tmpfs holds, not the length
            except OSError:
                pass
    return total


def _in_use(path: Path) -> bool:
    """True if a process of this user has a file under ``path`` open or mapped, or if that cannot be told."""
    if not os.path.isdir("/proc/self/fd"):
        return True
    root, me = f"{path}{os.sep}", os.getuid()
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != me:
                continue
            for fd in os.scandir(os.path.join(proc.path, "fd")):
                if os.readlink(fd.path).startswith(root):
                    return True
            with open(os.path.join(proc.path, "maps")) as maps:
                if root in maps.read():
                    return True
        except OSError:  # it exited meanwhile
            continue
    return False


def _remove_if_unused(path: Path, prefix: str) -> int | None:
    """Removes an unlocked-by-design ``path`` (no ``.owner``) if no process uses it: the bytes freed, or None."""
    if _in_use(path):
        return None
    size = _size(path)
    _remove(path, prefix)
    return size


def _remove_if_dead(path: Path, prefix: str) -> int | None:
    """Removes ``path`` if its owner is dead: returns the bytes freed, or None if it is alive or already gone."""
    try:
        fd = os.open(path / OWNER, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError:  # another user's directory, or not a directory: not ours to judge
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live owner holds it
        size = _size(path)
        _remove(path, prefix)
        return size
    finally:
        os.close(fd)


def sweep_dead(prefix: str, base: str | os.PathLike) -> Swept:
    """Removes the directories under ``base`` named ``prefix*`` (or half made or half removed, ``.{prefix}*``) whose
    owner died, and those without an owner that are past the grace period and used by no process."""
    removed, legacy = [], []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return Swept()
    for entry in entries:
        hidden = entry.name.startswith(f".{prefix}")
        if not (hidden or entry.name.startswith(prefix)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue  # another user's directory is not ours to judge
            has_owner = os.path.exists(os.path.join(entry.path, OWNER))
            age = time.time() - st.st_mtime
        except OSError:
            continue
        path = Path(entry.path)
        gone = entry.name.startswith(f".{prefix}gone-")  # half removed: its remover held the lock throughout
        if hidden and not gone and age <= UNLOCKED_GRACE_S:
            continue  # its maker may be between creating .owner and locking it
        if has_owner:
            freed = _remove_if_dead(path, prefix)
        elif gone or age > UNLOCKED_GRACE_S:
            freed = _remove_if_unused(path, prefix)
        else:
            freed = None
        if freed is not None:
            removed.append((entry.path, freed))
        elif not has_owner and not hidden:
            legacy.append((entry.path, _size(path)))
    if removed:
        logger.info("removed %d scratch directories of dead processes (%.1f MB): %s", len(removed),
                    sum(n for _, n in removed) / 1e6, ", ".join(p for p, _ in removed))
    if legacy:
        logger.warning("%d directories %s* (%.1f MB) have no owner lock and are in use or younger than %.0f s: left "
                       "alone for now (the next sweep removes them once no process uses them): %s", len(legacy),
                       os.path.join(str(base), prefix), sum(n for _, n in legacy) / 1e6, UNLOCKED_GRACE_S,
                       " ".join(p for p, _ in legacy))
    return Swept(tuple(removed), tuple(legacy))


def make_owned_dir(prefix: str, base: str | os.PathLike | None = None, *,
                   suffix: str | None = None) -> tuple[OwnedDir, Swept]:
    """Sweeps dead siblings, then makes ``base/{prefix}XXXX`` with its owner lock held by this process.

    Args:
        prefix: the directory name's prefix (e.g. ``"asyncrl-weights-"``); siblings with it are swept.
        base: the parent directory (default: the system temp directory).
        suffix: a fixed name after the prefix (a run's own directory, the same for its resume) instead of a random
            one; a directory of that name left by a dead owner, or without an owner lock, is replaced.

    Returns:
        The directory (remove it with :meth:`OwnedDir.close`) and what the sweep removed.

    Raises:
        FileExistsError: ``suffix`` names a directory whose owner is alive.
    """
    base = str(base) if base is not None else tempfile.gettempdir()
    swept = sweep_dead(prefix, base)
    if suffix is not None:
        named = Path(base, f"{prefix}{suffix}")
        if named.exists() and _remove_if_dead(named, prefix) is None:
            if (named / OWNER).exists():
                raise FileExistsError(f"{named} is in use by a live process (its {OWNER} is locked)")
            _remove(named, prefix)  # no owner lock: made before there were any, or half removed; nobody's now
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}new-", dir=base))
    fd = os.open(tmp / OWNER, os.O_RDWR | os.O_CREAT, 0o600)  # close-on-exec: exec'd children do not hold it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh file: nobody else can hold it
    name = suffix if suffix is not None else tmp.name[len(f".{prefix}new-"):]
    while True:
        final = Path(base, f"{prefix}{name}")
        if not final.exists():  # random names: a clash is a freak, and rename would replace an empty directory
            try:
                os.rename(tmp, final)
                return OwnedDir(final, fd, prefix), swept
            except OSError:  # made under that name meanwhile, or the half-made directory is gone
                if not tmp.is_dir():
                    os.close(fd)
                    raise FileNotFoundError(f"{tmp} vanished while it was being made (removed by hand?)") from None
        if suffix is not None:
            _remove(tmp, prefix)
            os.close(fd)
            raise FileExistsError(f"{final} was made by another process meanwhile")
        name = secrets.token_hex(4)
