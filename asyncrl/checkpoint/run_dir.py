"""The run directory: held by one run at a time, its records continued from the resumed step.

A run directory holds a run's checkpoints and its records (``metrics.jsonl``, ``consumed-rank{r}.jsonl``,
``debug/steps-rank{r}.jsonl``, ``debug/anomalies.jsonl``, ``samples.jsonl``). Two runs writing into one directory, or a
resumed run appending after lines of steps it rolled back, make every report and every exactly-once
count wrong. Two rules keep it one run's history:

- :class:`RunDirLock`: a run holds ``run_dir/.lock`` (``fcntl.flock``, exclusive, non-blocking) from its
  start to its end; the file names the holder (pid, host, start time, command). A second run, fresh
  or ``--resume``, is refused at once with :class:`RunDirLocked`, a sentence naming the holder. The
  kernel releases the lock when the holder's process ends, SIGKILL included, so no stale lock is
  ever left behind; the holder's file stays as a note of the last run.
- :func:`truncate_records`: on resume from step N, each record file is rewritten atomically (temp
  file + ``os.replace``) keeping only the lines with ``step <= N`` (and no torn last line), before
  the run appends to it. A kill during the rewrite leaves the old file or the new one, never half.

Limits: ``flock`` is advisory and per host; on NFS it is emulated with byte-range locks (Linux >= 2.6.12),
so two hosts sharing a run directory over NFS are excluded only where the server supports locks.
A process forked without exec while the lock is held inherits it (the file is close-on-exec).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "RunDirLock", "RunDirLocked", "continue_records", "hold_run_dir", "record_files",
           "truncate_records"]

LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """Exclusive use of a run directory while a run uses it (rank 0 holds it for the whole run).

    Args:
        run_dir: the run directory (created if missing).

    Who blocks on what: nothing; :meth:`acquire` never waits, it succeeds or raises.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, command: list[str] | None = None) -> None:
        """Takes the lock and writes the holder's note into the lock file.

        Raises:
            RunDirLocked: another process holds it; the message names that process.
        """
        if self._fd is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: workers do not inherit it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirLocked(self._refusal()) from None
        note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "command": " ".join(command if command is not None else [sys.executable, *sys.argv])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def holder(self) -> dict[str, Any] | None:
        """The note the (last) holder wrote, or None if there is none yet."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return None

    def _refusal(self) -> str:
        h = self.holder()
        who = (f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}: {h.get('command')}" if h
               else "a process that has not written its note yet")
        return (f"run directory {self.run_dir} is in use by another run ({who}); stop that run first "
                f"(its lock is released when it exits, even by SIGKILL) or choose another run_dir")

    def release(self) -> None:
        """Releases the lock (the note stays, naming the last holder)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def truncate_records(path: str | os.PathLike, step: int) -> tuple[int, int]:
    """Rewrites a JSON-lines record file keeping the lines with ``"step" <= step``, atomically.

    Lines that do not parse (a torn last write) are dropped too. A missing file is left missing.

    Args:
        path: a record file whose every line is a JSON object with an integer ``"step"``.
        step: the step the run resumes from (its checkpoint's step); later lines belong to a rolled-back timeline.

    Returns:
        ``(kept, dropped)`` line counts.

    Raises:
        ValueError: a parseable line has no integer ``"step"`` (not a record file).
    """
    path = Path(path)
    if not path.exists():
        return 0, 0
    kept: list[bytes] = []
    dropped = 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a write torn by the kill
            dropped += 1
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}: line without an integer 'step' ({line[:80]!r}); not a record file")
        if row["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(kept), dropped


def hold_run_dir(run_dir: str | os.PathLike) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock for the whole run; every rank learns the outcome (a collective when a
    process group is initialised, so no rank waits for the others when another run holds it).

    Returns:
        the held lock on rank 0 (release it last, after everything is written), None on the other ranks.

    Raises:
        RunDirLocked: on every rank, with the sentence naming the holder.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    lock = RunDirLock(run_dir) if rank == 0 else None
    refusal: list[str | None] = [None]
    if lock is not None:
        try:
            lock.acquire()
        except RunDirLocked as e:
            refusal = [str(e)]
    if distributed:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunDirLocked(refusal[0])
    return lock


def record_files(run_dir: str | os.PathLike, rank: int) -> list[Path]:
    """The record files rank ``rank`` continues on resume: its consumed log and debugger steps; rank 0 also the
    shared ``metrics.jsonl``, ``debug/anomalies.jsonl`` and ``samples.jsonl``."""
    run_dir = Path(run_dir)
    paths = [run_dir / f"consumed-rank{rank}.jsonl", run_dir / "debug" / f"steps-rank{rank}.jsonl"]
    if rank == 0:
        paths += [run_dir / "metrics.jsonl", run_dir / "debug" / "anomalies.jsonl", run_dir / "samples.jsonl"]
    return paths


def continue_records(paths: list[Path], step: int, *, who: str = "") -> None:
    """Resuming from ``step``: each record file keeps only the lines of steps ``<= step`` (the rolled-back steps
    are trained and logged again, so reports and exactly-once counts see each step once); says what it dropped.
    With a process group, ends with a barrier (shared files are rewritten before any rank appends)."""
    import torch.distributed as dist

    for path in paths:
        kept, dropped = truncate_records(path, step)
        if dropped:
            print(f"{who}{path}: dropped {dropped} lines of steps after {step} (rolled back), kept {kept}",
                  file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
