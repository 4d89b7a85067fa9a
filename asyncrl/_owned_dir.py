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
visible under the prefix is locked from its first moment and a sweep never races its maker. A crash before the
rename leaves a hidden ``.{prefix}new-*`` directory, swept once it is older than :data:`UNLOCKED_GRACE_S`
(younger, its maker may be between creating ``.owner`` and locking it) and its lock is free or it has none. A directory under the prefix without ``.owner`` was made by an asyncrl older than
this module: it is named in a warning with its size, never removed (its owner may be alive).

Who blocks on what: nothing; every lock attempt is non-blocking.
"""

from __future__ import annotations

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
    """What one sweep removed (``removed``: paths and bytes) and left alone (``legacy``: made without an owner)."""

    removed: tuple[tuple[str, int], ...] = ()
    legacy: tuple[tuple[str, int], ...] = ()

    @property
    def removed_bytes(self) -> int:
        return sum(n for _, n in self.removed)


class OwnedDir:
    """A scratch directory and the owner lock that marks it in use; :meth:`close` removes both."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def close(self) -> None:
        """Removes the directory, then releases the lock (idempotent)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)  # the lock goes with the last descriptor of the file
        self._fd = None


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512  # what tmpfs holds, not the length
            except OSError:
                pass
    return total


def _remove_if_dead(path: Path) -> int | None:
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
        shutil.rmtree(path, ignore_errors=True)
        return size
    finally:
        os.close(fd)


def sweep_dead(prefix: str, base: str | os.PathLike) -> Swept:
    """Removes the directories under ``base`` named ``prefix*`` (or half-made ``.{prefix}new-*``) whose owner died."""
    removed, legacy = [], []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return Swept()
    for entry in entries:
        hidden = entry.name.startswith(f".{prefix}new-")
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
        if hidden and age <= UNLOCKED_GRACE_S:
            continue  # its maker may be between creating .owner and locking it
        if has_owner:
            freed = _remove_if_dead(path)
            if freed is not None:
                removed.append((entry.path, freed))
        elif hidden:
            freed = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append((entry.path, freed))
        else:
            legacy.append((entry.path, _size(path)))
    if removed:
        logger.info("removed %d scratch directories of dead processes (%.1f MB): %s", len(removed),
                    sum(n for _, n in removed) / 1e6, ", ".join(p for p, _ in removed))
    if legacy:
        logger.warning("%d directories %s* (%.1f MB) were made by an older asyncrl without an owner lock and are "
                       "left alone; remove them by hand once no run uses them: %s", len(legacy),
                       os.path.join(str(base), prefix), sum(n for _, n in legacy) / 1e6, " ".join(p for p, _ in legacy))
    return Swept(tuple(removed), tuple(legacy))


def make_owned_dir(prefix: str, base: str | os.PathLike | None = None) -> tuple[OwnedDir, Swept]:
    """Sweeps dead siblings, then makes ``base/{prefix}XXXX`` with its owner lock held by this process.

    Args:
        prefix: the directory name's prefix (e.g. ``"asyncrl-weights-"``); siblings with it are swept.
        base: the parent directory (default: the system temp directory).

    Returns:
        The directory (remove it with :meth:`OwnedDir.close`) and what the sweep removed.
    """
    base = str(base) if base is not None else tempfile.gettempdir()
    swept = sweep_dead(prefix, base)
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}new-", dir=base))
    fd = os.open(tmp / OWNER, os.O_RDWR | os.O_CREAT, 0o600)  # close-on-exec: exec'd children do not hold it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh file: nobody else can hold it
    suffix = tmp.name[len(f".{prefix}new-"):]
    while True:
        final = Path(base, f"{prefix}{suffix}")
        if not final.exists():  # random names: a clash is a freak, and rename would replace an empty directory
            try:
                os.rename(tmp, final)
                return OwnedDir(final, fd), swept
            except OSError:  # made under that name meanwhile, or the half-made directory is gone
                if not tmp.is_dir():
                    os.close(fd)
                    raise FileNotFoundError(f"{tmp} vanished while it was being made (removed by hand?)") from None
        suffix = secrets.token_hex(4)
