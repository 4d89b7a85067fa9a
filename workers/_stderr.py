"""A local worker's stderr, still shown where it always was and its last lines kept for the error that names it.

::

    worker process ──stderr pipe──► reader thread ──► the trainer's stderr (fd 2), line by line, as before
                                         └─────────► the last ``lines`` lines (a ring buffer) ──► StderrTail.text()

A worker started with ``stderr=PIPE`` would block once the pipe's buffer fills if nobody read it, so each worker has
a reader thread from its first moment (:meth:`StderrTail.attach`, right after ``Popen``) to its end of file (the
process exited and closed the pipe). Who blocks on what: the reader thread blocks in ``readline`` on the pipe and in
writing to fd 2 (as the worker itself did when it inherited fd 2); the trainer never blocks here except in
:meth:`StderrTail.text` after the process exited, for at most ``timeout`` seconds while the thread drains what
is left.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import threading
from typing import ClassVar

__all__ = ["StderrTail", "signature"]

TAIL_LINES = 30
"""Lines of a worker's stderr kept for its error."""


class StderrTail:
    """Forwards a process's stderr pipe to this process's fd 2 and keeps its last ``lines`` lines.

    Args:
        proc: a process started with ``stderr=subprocess.PIPE``.
        lines: how many lines to keep.
    """

    _attached: ClassVar[dict[int, StderrTail]] = {}  # pid -> its tail, while the process may still be handed on (prestart)

    @classmethod
    def attach(cls, proc: subprocess.Popen) -> StderrTail:
        """The tail of ``proc``: the one attached when it started (a prestarted process handed to a launcher), else a
        new one."""
        tail = cls._attached.pop(proc.pid, None)
        return tail if tail is not None and tail.pid == proc.pid else cls(proc)

    @classmethod
    def register(cls, proc: subprocess.Popen) -> StderrTail:
        """Starts reading ``proc``'s stderr now and keeps the tail for :meth:`attach` (a prestarted process)."""
        tail = cls._attached[proc.pid] = cls(proc)
        return tail

    def __init__(self, proc: subprocess.Popen, lines: int = TAIL_LINES):
        if proc.stderr is None:
            raise ValueError(f"process {proc.pid} was not started with stderr=subprocess.PIPE")
        self.pid = proc.pid
        self._pipe = proc.stderr
        self._lines: collections.deque[bytes] = collections.deque(maxlen=lines)
        self._thread = threading.Thread(target=self._run, name=f"stderr-{proc.pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        forward = True
        for line in iter(self._pipe.readline, b""):
            self._lines.append(line)
            if forward:
                try:
                    os.write(2, line)
                except OSError:  # our stderr is gone (closed, a broken pipe): keep draining, keep the tail
                    forward = False
        self._pipe.close()

    def text(self, timeout: float = 2.0) -> str:
        """The last lines, decoded; waits up to ``timeout`` s for the reader to reach the end of file (call it once
        the process exited, so the lines it wrote just before are in)."""
        self._thread.join(timeout)
        return b"".join(self._lines).decode(errors="replace").rstrip()


def signature(tail: str, returncode: int | None) -> str:
    """What identifies a worker's death across restarts: its last stderr line (an exception's ``Type: message``)
    with numbers blanked (pids, ports, addresses differ between attempts), else its exit status."""
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    if last:
        return re.sub(r"0x[0-9a-fA-F]+|\d+", "#", last)
    return f"exit status {returncode}"
