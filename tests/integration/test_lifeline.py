"""Parent death (asyncrl.lifeline): a child armed with ``die_with_parent`` exits when its parent is
SIGKILLed, also while it is still starting up (a rollout worker importing torch, waiting for its pools),
and does *not* exit when only the parent thread that spawned it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie is reaped by init, not us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pid: int, deadline_s: float) -> float:
    t0 = time.monotonic()
    while _alive(pid):
        if time.monotonic() - t0 > deadline_s:
            os.kill(pid, signal.SIGKILL)  # ours (a grandchild we started): don't leak it
            pytest.fail(f"pid {pid} outlived its SIGKILLed parent by more than {deadline_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _parent(child_argv: list[str], *, spawn_in_thread: Path | None = None) -> tuple[subprocess.Popen, int]:
    """Starts a parent process that starts ``child_argv`` (``{ppid}`` replaced by its own pid) and prints the
    child's pid; with ``spawn_in_thread=FLAG`` the child is spawned from a thread that ends once FLAG exists."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys, threading, time
        argv = [a.replace("{{ppid}}", str(os.getpid())) for a in {child_argv!r}]
        out = []
        flag = {str(spawn_in_thread) if spawn_in_thread else None!r}
        def spawn():
            out.append(subprocess.Popen(argv))
            while flag and not os.path.exists(flag):  # the child armed: now end the thread that spawned it
                time.sleep(0.02)
        if flag:
            t = threading.Thread(target=spawn); t.start(); t.join()
        else:
            spawn()
        print(out[0].pid, flush=True)
        sys.stdin.readline()  # lives until told (or killed)
        out[0].kill(); out[0].wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    return proc, int(proc.stdout.readline())


def _armed_child(flag: Path) -> list[str]:
    """A child that arms its lifeline, then touches ``flag`` and idles."""
    return [sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from asyncrl.lifeline import die_with_parent
        die_with_parent(what="test child")
        pathlib.Path({str(flag)!r}).touch()
        while True:
            time.sleep(0.05)
    """)]


def test_armed_child_exits_when_its_parent_is_sigkilled(tmp_path):
    flag = tmp_path / "armed"
    parent, child = _parent(_armed_child(flag))
    deadline = time.monotonic() + 60
    while not flag.exists():  # without a parent pid given, a parent dead before the child armed goes unnoticed
        assert time.monotonic() < deadline and _alive(child), "the child never armed its lifeline"
        time.sleep(0.02)
    parent.kill()
    parent.wait()
    took = _wait_gone(child, deadline_s=10)
    print(f"child gone {took:.2f} s after its parent's SIGKILL")


def test_armed_child_survives_the_end_of_the_thread_that_spawned_it(tmp_path):
    # PR_SET_PDEATHSIG fires when the spawning *thread* ends: the handler must see the parent alive and stay
    flag = tmp_path / "armed"
    parent, child = _parent(_armed_child(flag), spawn_in_thread=flag)
    try:
        # the kernel sent the signal when the thread ended (before the pid was printed); give its handler and one
        # watchdog poll time to act wrongly: a negative check needs a wait, bounded by what it waits for
        time.sleep(1.0)
        assert _alive(child), "the child died when its parent's spawning thread ended"
    finally:
        parent.kill()
        parent.wait()
    _wait_gone(child, deadline_s=10)


def test_worker_still_starting_up_exits_with_its_killed_parent():
    # nothing listens at the endpoint: the worker sits in its handshake (transport.handshake_timeout_s=120);
    # before the lifeline it outlived its parent for the whole handshake timeout
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "workers", "--worker-id", "orphan-0", "--parent-pid", "{ppid}",
            "--connect", f"tcp://127.0.0.1:{port}", "--set", "worker.engine.type=fake",
            "--set", "worker.weights.type=none", "--set", "transport.handshake_timeout_s=120"]
    parent, worker = _parent(argv)
    parent.kill()
    parent.wait()
    took = _wait_gone(worker, deadline_s=20)
    print(f"starting worker gone {took:.2f} s after its parent's SIGKILL")
