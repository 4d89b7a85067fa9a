"""The local launcher: starts rollout workers as child processes, like ``DataLoader(num_workers=N)``.

Each worker is a fresh interpreter (``python -m workers``, not a fork: ZeroMQ contexts and torch
threads do not survive fork) that connects to the given pool endpoints. The launcher restarts
workers that die (their leases are re-issued by the pool either way) and ends only the processes
it started, by pid: SIGTERM, then SIGKILL after a grace period. Workers also exit on their own
when the launcher's process disappears.

Restarts are supervised from the trainer's thread (:meth:`LocalWorkerLauncher.poll`, called between
waits for groups; it never blocks): a slot whose worker died is restarted after ``backoff_s``,
doubled for each further death of a worker that ran less than ``backoff_max_s`` (a worker that
stayed up that long resets the slot's backoff), at most ``max_restarts`` times per slot (None:
always). Every death, delay and restart is logged and counted in :meth:`~LocalWorkerLauncher.stats`.

A worker that cannot start is not restarted forever: a slot whose worker died ``max_failed_starts`` times in a row
before serving (the loader tells the launcher which processes delivered a group: :meth:`~LocalWorkerLauncher.served`)
with the same error each time (the last line of its stderr, numbers aside: :func:`workers._stderr.signature`) is
given up, and :meth:`~LocalWorkerLauncher.start_error` returns a :class:`WorkerStartError` with the worker's last
stderr lines, which the loader raises from ``next()``. Each worker's stderr goes to the trainer's stderr as before,
through a pipe whose last lines are kept (:class:`workers._stderr.StderrTail`).

Start-up: a worker's first start takes a process :func:`workers.prestart.prestart_workers` started earlier,
if one is waiting with the same environment (its imports overlapped the trainer's start-up); restarts are cold.

Devices: with ``worker.devices`` each slot gets its own (``--device``), and the worker process pins itself to
it before its engine starts (:func:`pin_device`: ``CUDA_VISIBLE_DEVICES`` = those GPUs, the engine on the first).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.codec import dumps_json
from asyncrl.config import TransportConfig, WorkerConfig, to_dict
from workers._stderr import StderrTail, signature
from workers.prestart import take_prestarted, worker_env

__all__ = ["LocalWorkerLauncher", "WorkerStartError", "pin_device"]

logger = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """A local worker died ``deaths`` times in a row before serving, with the same error each time: it cannot start.

    Attributes:
        worker_id: the worker's id (``{name}-{slot}``).
        deaths: its deaths in a row before a first group.
        returncode: the last process's exit status (negative: killed by that signal).
        stderr: the last lines the last process wrote to stderr.
    """

    def __init__(self, worker_id: str, deaths: int, returncode: int | None, stderr: str):
        self.worker_id, self.deaths, self.returncode, self.stderr = worker_id, deaths, returncode, stderr
        last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()),
                    f"exit status {returncode}, nothing on stderr")
        super().__init__(f"rollout worker {worker_id} cannot start: it died {deaths} times in a row before its first "
                         f"group, each time with: {last}\n--- its last stderr lines ---\n{stderr}")

    def __reduce__(self):  # picklable across processes
        return type(self), (self.worker_id, self.deaths, self.returncode, self.stderr)


class LocalWorkerLauncher:
    """Starts and supervises ``num_workers`` local worker processes.

    Args:
        endpoints: pool endpoints every worker connects to.
        num_workers: how many processes.
        worker: worker config (engine, reward, credits).
        transport: transport config (timeouts, limits).
        name: prefix of worker ids (``{name}-{i}``).
        max_restarts: restarts per worker slot before giving up on it; None = unlimited.
        backoff_s: wait before the first restart of a slot; doubled per further quick death.
        backoff_max_s: longest wait; a worker up for this long resets its slot's backoff.
        env: extra environment variables for the workers.
        max_failed_starts: deaths in a row before serving, with the same error, after which a slot is given up
            (:meth:`start_error`); None: restarts as ``max_restarts`` says, whatever the error.
        device_offset: the global index of slot 0 (``rank * num_workers``): slot ``i`` gets
            ``worker.devices[(device_offset + i) % len(worker.devices)]``.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        num_workers: int,
        worker: WorkerConfig,
        transport: TransportConfig,
        *,
        name: str = "w",
        max_restarts: int | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        env: dict[str, str] | None = None,
        max_failed_starts: int | None = None,
        device_offset: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_restarts is not None and max_restarts < 0:
            raise ValueError(f"{max_restarts=} must be >= 0 (or None: unlimited)")
        if max_failed_starts is not None and max_failed_starts < 1:
            raise ValueError(f"{max_failed_starts=} must be >= 1 (or None: no limit)")
        if not 0 <= backoff_s <= backoff_max_s:
            raise ValueError(f"need 0 <= {backoff_s=} <= {backoff_max_s=}")
        self.endpoints = list(endpoints)
        self.num_workers = num_workers
        self.worker = worker
        self.transport = transport
        self.name = name
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.device_offset = device_offset
        self.env = worker_env(env)
        self.procs: list[subprocess.Popen | None] = [None] * num_workers
        self.max_failed_starts = max_failed_starts
        self.tails: list[StderrTail | None] = [None] * num_workers
        """The stderr tail of each slot's last process."""
        self.failed_starts = [0] * num_workers
        """Deaths in a row before serving per slot, with the same error (:func:`workers._stderr.signature`)."""
        self._served = [False] * num_workers  # the slot's current process delivered a group
        self._failure: list[str | None] = [None] * num_workers  # the signature of the slot's last death before serving
        self._start_errors: list[WorkerStartError | None] = [None] * num_workers
        self.restarts = [0] * num_workers
        """Restarts used per slot."""
        self.deaths = [0] * num_workers
        self._streak = [0] * num_workers  # quick deaths in a row per slot (the backoff exponent)
        self._started_at = [0.0] * num_workers
        self._restart_at: list[float | None] = [None] * num_workers  # scheduled restart per slot
        self.restart_delays: list[collections.deque[float]] = [collections.deque(maxlen=32) for _ in range(num_workers)]
        """The last waits (seconds) scheduled before restarting each slot."""
        self.closed = False
        """Set by :meth:`shutdown`: nothing is started or restarted any more."""
        self._finalizer = weakref.finalize(self, _terminate, self.procs)

    def _argv(self, i: int) -> list[str]:
        argv = [sys.executable, "-m", "workers", "--worker-id", f"{self.name}-{i}", "--parent-pid", str(os.getpid())]
        for ep in self.endpoints:
            argv += ["--connect", ep]
        if device := self.device(i):
            argv += ["--device", device]
        argv += ["--config-json", dumps_json({"worker": to_dict(self.worker), "transport": to_dict(self.transport)}).decode()]
        return argv

    def device(self, i: int) -> str | None:
        """The device of slot ``i`` (None: no ``worker.devices``)."""
        devices = self.worker.devices
        return devices[(self.device_offset + i) % len(devices)] if devices else None

    def start(self) -> None:
        for i in range(self.num_workers):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        if self.closed:
            raise RuntimeError(f"launcher {self.name} is shut down: worker slot {i} is not started")
        self._started_at[i] = self.clock()
        argv = self._argv(i)
        # a first start takes a prestarted interpreter (workers.prestart: its imports are done) if one waits
        warm = take_prestarted(argv, self.env) if self.restarts[i] == 0 and self.deaths[i] == 0 else None
        self.procs[i] = warm or subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tails[i] = StderrTail.attach(self.procs[i])  # shown as before, its last lines kept
        self._served[i] = False
        logger.info("started worker %s-%d (pid %d%s)", self.name, i, self.procs[i].pid, ", prestarted" if warm else "")

    @property
    def pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self.procs]

    def served(self, pids: Any) -> None:
        """Marks the workers whose process ids are in ``pids`` as having delivered a group: their deaths are not
        failed starts (the loader passes the pids its pool received groups from)."""
        pids = set(pids)
        for i, p in enumerate(self.procs):
            if p is not None and p.pid in pids and not self._served[i]:
                self._served[i] = True
                self.failed_starts[i], self._failure[i] = 0, None

    def start_error(self) -> WorkerStartError | None:
        """The error of the first slot given up because its worker cannot start (see the module docstring), or None."""
        return next((e for e in self._start_errors if e is not None), None)

    def stderr_tail(self, i: int) -> str:
        """The last stderr lines of slot ``i``'s last process ("" if it has none)."""
        tail = self.tails[i]
        return tail.text() if tail is not None else ""

    def _failed_start(self, i: int, returncode: int) -> bool:
        """Counts a death of slot ``i``'s worker; True if the slot is given up (it cannot start)."""
        if self._served[i]:
            self.failed_starts[i], self._failure[i] = 0, None
            return False
        tail = self.stderr_tail(i)
        failure = signature(tail, returncode)
        self.failed_starts[i] = self.failed_starts[i] + 1 if failure == self._failure[i] else 1
        self._failure[i] = failure
        if self.max_failed_starts is None or self.failed_starts[i] < self.max_failed_starts:
            return False
        self._start_errors[i] = WorkerStartError(f"{self.name}-{i}", self.failed_starts[i], returncode, tail)
        return True

    def poll(self, restart: bool = True) -> list[tuple[int, int]]:
        """Finds workers that exited and schedules their restarts; starts those now due. Never blocks.

        Args:
            restart: False: record deaths but restart nothing (any restart scheduled stays due).

        Returns:
            ``[(slot, returncode)]`` of the workers found dead by this call.
        """
        now = self.clock()
        dead = []
        restart = restart and not self.closed
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                dead.append((i, p.returncode))
                self.procs[i] = None
                self.deaths[i] += 1
                if not self.closed and self._failed_start(i, p.returncode):
                    logger.error("worker %s-%d (pid %d) exited with %s before its first group, %d times in a row with "
                                 "the same error; not restarted: it cannot start", self.name, i, p.pid, p.returncode,
                                 self.failed_starts[i])
                elif restart and (self.max_restarts is None or self.restarts[i] < self.max_restarts):
                    delay = self._backoff(i, ran_s=now - self._started_at[i])
                    self._restart_at[i] = now + delay
                    self.restart_delays[i].append(delay)
                    logger.warning("worker %s-%d (pid %d) exited with %s after %.1f s; restart %d of %s in %.1f s",
                                   self.name, i, p.pid, p.returncode, now - self._started_at[i], self.restarts[i] + 1,
                                   "unlimited" if self.max_restarts is None else self.max_restarts, delay)
                elif not self.closed:
                    logger.warning("worker %s-%d (pid %d) exited with %s; not restarted (%d restarts used of %s)",
                                   self.name, i, p.pid, p.returncode, self.restarts[i], self.max_restarts)
        for i, due in enumerate(self._restart_at):
            if restart and due is not None and due <= now and self.procs[i] is None:
                self._restart_at[i] = None
                self.restarts[i] += 1
                self._spawn(i)
        return dead

    def _backoff(self, i: int, ran_s: float) -> float:
        """The wait before restarting slot ``i`` whose worker ran ``ran_s`` seconds; advances its streak."""
        if ran_s >= self.backoff_max_s:
            self._streak[i] = 0  # it stayed up a while: a fresh failure, not a crash loop
        delay = min(self.backoff_s * 2.0 ** self._streak[i], self.backoff_max_s)
        self._streak[i] += 1
        return delay

    @property
    def pending_restarts(self) -> list[int]:
        """Slots whose worker is dead with a restart scheduled."""
        return [i for i, due in enumerate(self._restart_at) if due is not None]

    def recoverable(self) -> bool:
        """True while some worker is alive or a restart is scheduled."""
        return self.alive() > 0 or bool(self.pending_restarts)

    def stats(self) -> dict[str, Any]:
        """Worker supervision counters (``loader.stats()["workers"]``)."""
        return {
            "alive": self.alive(),
            "deaths": list(self.deaths),
            "restarts": list(self.restarts),
            "max_restarts": self.max_restarts,
            "pending_restarts": self.pending_restarts,
            "last_restart_delay_s": [d[-1] if d else None for d in self.restart_delays],
            "failed_starts": list(self.failed_starts),
        }

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
        """Ends every worker (SIGTERM, then SIGKILL after ``timeout``); no slot is restarted afterwards."""
        self.closed = True
        self._restart_at = [None] * self.num_workers
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


def pin_device(device: str, environ: dict[str, str] | None = None) -> str:
    """Pins this process to ``device`` and returns the engine's device within what it now sees.

    ``cuda:i[,j,...]`` sets ``CUDA_VISIBLE_DEVICES`` to those GPUs (indices into the GPUs this process already
    sees, when ``CUDA_VISIBLE_DEVICES`` is set) and returns ``cuda:0``; ``cpu`` and ``cuda`` are returned as
    they are. Call it before CUDA is initialised (the worker does, before its engine starts).

    Raises:
        ValueError: an index beyond the GPUs ``CUDA_VISIBLE_DEVICES`` lists, or a malformed device.
    """
    environ = os.environ if environ is None else environ
    if device in ("cpu", "cuda"):
        return device
    kind, _, indices = device.partition(":")
    if kind != "cuda" or not indices or not all(i.isdigit() for i in indices.split(",")):
        raise ValueError(f"device {device!r} must be 'cpu', 'cuda', 'cuda:N' or 'cuda:N,M,...'")
    wanted = [int(i) for i in indices.split(",")]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        seen = [v.strip() for v in visible.split(",") if v.strip()]
        if max(wanted) >= len(seen):
            raise ValueError(f"device {device!r}: this process sees only {len(seen)} GPUs ({visible=})")
        physical = [seen[i] for i in wanted]
    else:
        physical = [str(i) for i in wanted]
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical)
    return "cuda:0"
