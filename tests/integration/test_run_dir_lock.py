"""The run-directory lock across processes: a SIGKILLed holder releases it (the in-process rules:
tests/unit/checkpoint/test_run_dir.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.checkpoint.run_dir import RunDirLock, RunDirLocked

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


ROOT = Path(__file__).parents[2]


@pytest.mark.integration
def test_a_sigkilled_holder_releases_the_lock(tmp_path):
    code = ("import sys; from asyncrl.checkpoint.run_dir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} "):
            RunDirLock(tmp_path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock = RunDirLock(tmp_path)
    lock.acquire()  # no stale lock: the kernel released it with the process
    lock.release()
