"""Parent death: a process that must not outlive the process that started it.

Trainer ranks under ``torchrun`` and local rollout workers are children whose work only makes sense
while their parent lives: an orphaned rank goes on training and moving ``checkpoints/latest`` under a
resumed run; an orphaned worker holds memory and a GPU. ``torchrun`` starts its ranks in sessions of
their own, so killing its process group does not reach them. :func:`die_with_parent` arms two
independent mechanisms, because each misses cases the other catches:

- ``prctl(PR_SET_PDEATHSIG)`` (Linux): the kernel signals this process the moment its parent exits.
  The kernel's "parent" is the *thread* that spawned us, so the signal also fires when that thread
  ends while the parent process lives on (a loader's supervising or prefetching thread); the signal
  is therefore a catchable one (:data:`PARENT_DEATH_SIGNAL`) whose handler exits only if
  ``os.getppid()`` shows the parent really is gone. The signal is lost across a ``fork`` without
  ``exec`` and is checked only by the main thread, between bytecodes.
- a daemon watchdog thread that polls ``os.getppid()`` every ``poll_s`` against the original parent
  (it changes only when the whole parent process is gone, we are re-parented to init or a subreaper)
  and exits even while the main thread is stuck in a C call (a collective, an engine step).

Either way the process logs one line to stderr and leaves with ``os._exit(EXIT_CODE)``: no atexit
hooks, no ``finally`` blocks, nothing more written to the run directory. What the process started
(rollout workers) arms its own lifeline and follows; file locks (the run-directory lock) are released
by the kernel.

Who blocks on what: nothing blocks on the watchdog; it sleeps in ``Event.wait(poll_s)``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["EXIT_CODE", "PARENT_DEATH_SIGNAL", "die_with_parent", "end_run"]

EXIT_CODE = 70
"""Exit status of a process that left because its parent was gone (EX_SOFTWARE)."""

PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None
"""The signal the kernel sends on parent death: a real-time signal nothing else here uses, caught and checked
(SIGKILL could not tell the parent's death from the end of the parent thread that spawned us)."""

_PR_SET_PDEATHSIG = 1
_armed: dict[int, str] = {}  # parent pid -> what; one watchdog per parent, a second call is a no-op
_lock = threading.Lock()


def die_with_parent(parent_pid: int | None = None, *, what: str = "process", poll_s: float = 0.25) -> bool:
    """Makes this process exit as soon as ``parent_pid`` (default: the current parent) is gone.

    Call it first thing in the child, before slow imports or start-up: a parent that dies while the
    child starts is noticed too, and a parent already gone when it is called ends the child at once.

    Args:
        parent_pid: the process this one must not outlive (the local launcher passes its pid as
            ``--parent-pid``); None means ``os.getppid()`` now.
        what: names this process in the exit line (``"rank 0"``, ``"worker w-1"``).
        poll_s: the watchdog's polling interval, i.e. the latest it notices (seconds, > 0).

    Returns:
        True if armed by this call; False if already armed for this parent.

    Raises:
        ValueError: ``poll_s`` is not positive.
    """
    if poll_s <= 0:
        raise ValueError(f"{poll_s=} must be > 0")
    parent = os.getppid() if parent_pid is None else int(parent_pid)
    with _lock:
        if parent in _armed:
            return False
        _armed[parent] = what
    _set_pdeathsig(parent, what)
    if os.getppid() != parent:  # gone before we armed anything (or never our parent)
        _exit(parent, what)
    thread = threading.Thread(target=_watch, args=(parent, what, poll_s), name=f"lifeline-{parent}", daemon=True)
    thread.start()
    return True


def _set_pdeathsig(parent: int, what: str) -> None:
    """Arms the kernel's parent-death signal; silently nothing where there is no prctl (not Linux)."""
    if PARENT_DEATH_SIGNAL is None or not sys.platform.startswith("linux"):
        return
    if threading.current_thread() is threading.main_thread():  # only the main thread may install handlers
        def on_signal(signum, frame, parent=parent, what=what):
            if os.getppid() != parent:
                _exit(parent, what)
            # else: the thread that spawned us ended, not our parent; the kernel re-arms on the next one

        signal.signal(PARENT_DEATH_SIGNAL, on_signal)
    else:  # the default action of a real-time signal is to terminate: would kill us when a parent *thread* ends
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as e:  # the watchdog still covers us; say so once
        print(f"asyncrl.lifeline: {what}: no parent-death signal ({e}); relying on the watchdog", file=sys.stderr)


def _watch(parent: int, what: str, poll_s: float) -> None:
    stop = threading.Event()  # never set: the thread lives as long as the process (daemon)
    while os.getppid() == parent:
        stop.wait(poll_s)
    _exit(parent, what)


def _exit(parent: int, what: str) -> None:
    try:
        sys.stderr.write(f"asyncrl: {what} (pid {os.getpid()}): parent {parent} is gone; exiting "
                         f"at {time.strftime('%H:%M:%S')}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)


def end_run(proc: subprocess.Popen, run_dir: str | os.PathLike) -> None:
    """Ends a run started under torchrun: SIGKILL to the ranks (the pids they wrote to ``run_dir``; each runs
    in a session of its own and its workers exit with it), then torchrun itself."""
    for pid_file in Path(run_dir).glob("pid-rank*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    proc.kill()
    proc.communicate()
