"""What every benchmark's JSON says about where it ran: machine, versions, commit."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["git_commit", "machine"]


def git_commit() -> str | None:
    """HEAD's commit, read from ``.git`` (what ``git rev-parse HEAD`` prints); None outside a checkout."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(f" {ref}"):
                return line.split()[0]
    except OSError:
        pass
    return None


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
