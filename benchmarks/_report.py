"""What every benchmark's JSON says about where it ran: machine, versions, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["git_commit", "machine"]


def git_commit() -> str | None:
    """HEAD's commit as ``git rev-parse HEAD`` prints it (a worktree's ``.git`` is a file: git reads it); None
    outside a checkout or without git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent.parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine() -> dict[str, Any]:
    import torch
    import zmq

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "git_commit": git_commit(),
    }
