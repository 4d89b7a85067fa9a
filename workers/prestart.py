"""Prestarted local workers: interpreters that import torch and the engine's library while the trainer starts up.

A local worker's start-up is mostly imports (torch, transformers: ~4-6 s on a 2-core machine), and the local
launcher can only start workers once the pools exist, after the trainer has loaded its prompts, built its model
and started weight sync. :func:`prestart_workers` starts the interpreters first (``python -m workers
--await-argv``): each arms its parent lifeline, does the imports, then blocks reading its command line (one
JSON list of strings) from stdin. :meth:`~workers.launcher.LocalWorkerLauncher.start` hands a prestarted
process its argv and the environment variables changed since (:func:`take_prestarted`) instead of spawning a cold one, so the worker's imports overlap
the trainer's start-up. Restarts always spawn cold ones.

Who blocks on what: the worker blocks on its stdin until the launcher writes the argv and closes it; a
prestarted process that is never used reads EOF when its parent exits (or closes the pipe) and exits 0 at once,
even in the middle of its imports (a thread reads stdin from the start: torch's import can outlast any fixed wait on
a loaded machine), and dies with its parent either way (``--parent-pid``). The trainer never blocks here (writing
one short line to a pipe). A process whose import-time variables (threads, paths, devices) changed since it started
is killed and the worker starts cold.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from workers._stderr import StderrTail

__all__ = ["IMPORT_TIME_ENV", "await_argv", "end_prestarted", "prestart_workers", "take_prestarted", "worker_env"]

logger = logging.getLogger(__name__)

_PRELOAD = {
    "hf": ("torch", "transformers", "transformers.generation.utils", "workers.engines.hf", "workers.worker"),
    "fake": ("workers.worker",),
    "vllm": ("torch", "workers.worker"),  # not vllm itself: its import may look at CUDA before --device pins it
}
"""Modules a prestarted worker imports per engine type, before it knows its command line."""

IMPORT_TIME_ENV = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "LD_LIBRARY_PATH",
                             "LD_PRELOAD", "CUDA_VISIBLE_DEVICES"})
"""Variables a prestarted process has already acted on: when they change, it is not used."""

_prestarted: list[tuple[subprocess.Popen, dict[str, str]]] = []


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a local worker: one intra-op thread (the trainer gets the other cores,
    :mod:`asyncrl.train.threads`), unbuffered output, then ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


def prestart_workers(n: int, *, engine: str = "hf", env: dict[str, str] | None = None) -> list[int]:
    """Starts ``n`` worker interpreters that import ``engine``'s modules and wait for their argv; returns their pids.

    Raises:
        ValueError: ``n`` < 0 or an engine type with no preload list.
    """
    if n < 0 or engine not in _PRELOAD:
        raise ValueError(f"need {n=} >= 0 and engine in {sorted(_PRELOAD)}, got {engine=!r}")
    full_env = worker_env(env)
    argv = [sys.executable, "-m", "workers", "--parent-pid", str(os.getpid()), "--await-argv", "--preload", engine]
    for _ in range(n):
        proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        StderrTail.register(proc)  # its stderr shown as before, and kept for a launcher's error (workers._stderr)
        _prestarted.append((proc, full_env))
        logger.info("prestarted worker process %d (preloading %s)", proc.pid, engine)
    if n:
        atexit.register(end_prestarted)
    return [p.pid for p, _ in _prestarted[-n:]] if n else []


def take_prestarted(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen | None:
    """A prestarted process, now running ``python -m workers`` with ``argv[3:]`` in ``env``; None if none fits.

    ``argv`` must be a ``[python, "-m", "workers", ...]`` command line. Variables changed since the prestart
    (libraries set some in the trainer during its set-up, e.g. ``TORCHINDUCTOR_CACHE_DIR``) go with the argv and
    the worker applies them before it starts; a process that has exited, or whose environment differs in a
    variable read at import time (:data:`IMPORT_TIME_ENV`), is ended and skipped.
    """
    if list(argv[:3]) != [sys.executable, "-m", "workers"]:
        return None
    while _prestarted:
        proc, started_env = _prestarted.pop(0)
        changed = {k: v for k, v in env.items() if started_env.get(k) != v}
        unset = sorted(set(started_env) - set(env))
        refused = sorted(IMPORT_TIME_ENV & (set(changed) | set(unset)))
        if proc.poll() is None and not refused:
            line = json.dumps({"argv": list(argv[3:]), "env": changed, "unset": unset}).encode() + b"\n"
            try:
                proc.stdin.write(line)
                proc.stdin.close()
                return proc
            except (BrokenPipeError, OSError):  # it died between poll and write
                pass
        logger.info("prestarted worker %d not used (exit %s, import-time variables changed: %s)", proc.pid,
                    proc.poll(), refused)
        _end(proc, kill=True)
    return None


def end_prestarted() -> None:
    """Ends the prestarted processes no launcher took (closing their stdin: they exit 0, imports done or not)."""
    while _prestarted:
        _end(_prestarted.pop()[0])


def _end(proc: subprocess.Popen, timeout: float = 30.0, kill: bool = False) -> None:
    """Closes ``proc``'s stdin and waits for its exit (it exits on EOF at once); kills it past ``timeout``."""
    if kill and proc.poll() is None:  # unwanted: it need not finish its imports first
        proc.kill()
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def await_argv(argv: list[str], *, exit_on_early_eof: bool = False) -> list[str] | None:
    """The worker side (``python -m workers --await-argv --preload ENGINE``): imports, then the argv from stdin.

    A thread reads stdin while the imports run. Applies the environment changes sent with the argv to ``os.environ``.

    Args:
        exit_on_early_eof: on EOF, ``os._exit(0)`` at once, imports done or not (``python -m workers``: an unused
            process has nothing to keep; the trainer, ending it, need not wait for torch's import).

    Returns:
        The command line the launcher wrote; None on EOF (not used: the caller exits 0).

    Raises:
        ValueError: the line is not ``{"argv": [str, ...], "env": {str: str}, "unset": [str, ...]}``.
    """
    engine = argv[argv.index("--preload") + 1] if "--preload" in argv[:-1] else "fake"
    got_line: list[bytes] = []

    def read() -> None:
        got_line.append(sys.stdin.buffer.readline())
        if exit_on_early_eof and not got_line[0].strip():
            os._exit(0)  # never used (imports done or not): nothing to keep, nothing to flush

    reader = threading.Thread(target=read, name="prestart-stdin", daemon=True)
    reader.start()
    _import(engine)
    reader.join()
    line = got_line[0]
    if not line.strip():
        return None
    got = json.loads(line)
    args, env, unset = (got.get(k) for k in ("argv", "env", "unset")) if isinstance(got, dict) else (None,) * 3
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args) and isinstance(env, dict)
            and all(isinstance(v, str) for v in env.values()) and isinstance(unset, list)):
        raise ValueError(f"prestarted worker: expected {{'argv': [...], 'env': {{...}}, 'unset': [...]}} on stdin, "
                         f"got {line[:200]!r}")
    os.environ.update(env)
    for k in unset:
        os.environ.pop(k, None)
    return args


def preload(argv: list[str]) -> None:
    """A cold worker's (``python -m workers`` without ``--await-argv``) imports of a prestarted one: the modules of
    the engine type its ``--config-json`` names (the local launcher's argv), before its engine is built, so that
    they are imported while the collector is off (:mod:`asyncrl._gc`). Without one, ``workers.worker`` alone."""
    engine = "fake"
    if "--config-json" in argv[:-1]:
        try:
            engine = json.loads(argv[argv.index("--config-json") + 1])["worker"]["engine"]["type"]
        except (ValueError, KeyError, TypeError):  # the worker's own parsing names what is wrong with it
            pass
    _import(engine)


def _import(engine: str) -> None:
    import importlib

    for name in _PRELOAD.get(engine, _PRELOAD["fake"]):
        importlib.import_module(name)
