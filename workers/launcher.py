"""The local launcher: starts rollout workers as child processes, like ``DataLoader(num_workers=N)``.

Each worker is a fresh interpreter (``python -m workers``, not a fork: ZeroMQ contexts and torch
threads do not survive fork) that connects to the given pool endpoints. The launcher restarts
workers that die (their leases are re-issued by the pool either way) and ends only the processes
it started, by pid: SIGTERM, then SIGKILL after a grace period. Workers also exit on their own
when the launcher's process disappears.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Sequence

from asyncrl.codec import dumps_json
from asyncrl.config import TransportConfig, WorkerConfig, to_dict

__all__ = ["LocalWorkerLauncher"]

logger = logging.getLogger(__name__)


class LocalWorkerLauncher:
    """Starts and supervises ``num_workers`` local worker processes.

    Args:
        endpoints: pool endpoints every worker connects to.
        num_workers: how many processes.
        worker: worker config (engine, reward, credits).
        transport: transport config (timeouts, limits).
        name: prefix of worker ids (``{name}-{i}``).
        max_restarts: restarts per worker slot before giving up on it.
        env: extra environment variables for the workers.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        num_workers: int,
        worker: WorkerConfig,
        transport: TransportConfig,
        *,
        name: str = "w",
        max_restarts: int = 3,
        env: dict[str, str] | None = None,
    ):
        self.endpoints = list(endpoints)
        self.num_workers = num_workers
        self.worker = worker
        self.transport = transport
        self.name = name
        self.max_restarts = max_restarts
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.procs: list[subprocess.Popen | None] = [None] * num_workers
        self.restarts = [0] * num_workers
        self._finalizer = weakref.finalize(self, _terminate, self.procs)

    def _argv(self, i: int) -> list[str]:
        argv = [sys.executable, "-m", "workers", "--worker-id", f"{self.name}-{i}", "--parent-pid", str(os.getpid())]
        for ep in self.endpoints:
            argv += ["--connect", ep]
        argv += ["--config-json", dumps_json({"worker": to_dict(self.worker), "transport": to_dict(self.transport)}).decode()]
        return argv

    def start(self) -> None:
        for i in range(self.num_workers):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(self._argv(i), env=self.env, stdin=subprocess.DEVNULL)
        logger.info("started worker %s-%d (pid %d)", self.name, i, self.procs[i].pid)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self.procs]

    def poll(self, restart: bool = True) -> list[tuple[int, int]]:
        """Finds workers that exited; restarts them (up to ``max_restarts``). Returns ``[(slot, returncode)]``."""
        dead = []
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                dead.append((i, p.returncode))
                logger.warning("worker %s-%d (pid %d) exited with %s", self.name, i, p.pid, p.returncode)
                self.procs[i] = None
                if restart and self.restarts[i] < self.max_restarts:
                    self.restarts[i] += 1
                    self._spawn(i)
        return dead

    def alive(self) -> int:
        return sum(p is not None and p.poll() is None for p in self.procs)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` to worker ``i`` (fault injection in tests); returns its pid."""
        p = self.procs[i]
        if p is None:
            raise RuntimeError(f"worker slot {i} has no process")
        os.kill(p.pid, sig)
        return p.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        _terminate(self.procs, timeout)


def _terminate(procs: list[subprocess.Popen | None], timeout: float = 10.0) -> None:
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.terminate()
    for p in live:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
