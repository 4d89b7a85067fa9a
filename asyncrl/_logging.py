"""Log throttling: a failure that repeats hundreds of times a second logs a few lines, not megabytes.

A :class:`Throttle` passes the first ``burst`` records of a key, then at most one per ``interval_s``,
and that one says how many were suppressed since the last line::

    throttle = Throttle(logger)
    throttle.warning("batch_failed", "worker %s: batch of %d leases failed", worker_id, n, exc_info=True)

Keys name a kind of event ("batch_failed", "weights_failed"), not one occurrence, so the number of
keys stays small; beyond ``max_keys`` the least recently used key is forgotten. Thread-safe: the
worker's main thread and a receiver's I/O thread may share one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["Throttle"]


@dataclass(slots=True)
class _Key:
    seen: int = 0
    suppressed: int = 0
    next_at: float = 0.0


class Throttle:
    """Rate-limits log records per key.

    Args:
        logger: where records go.
        burst: records of a key logged before throttling starts.
        interval_s: after the burst, at most one record of a key per this many seconds.
        max_keys: keys remembered (least recently used forgotten first).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 3,
        interval_s: float = 10.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ):
        if burst < 0 or interval_s < 0 or max_keys < 1:
            raise ValueError(f"need {burst=} >= 0, {interval_s=} >= 0 and {max_keys=} >= 1")
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self.suppressed_total = 0
        """Records dropped so far, over all keys."""
        self._keys: collections.OrderedDict[Hashable, _Key] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _admit(self, key: Hashable) -> str | None:
        """None if the record is suppressed, else a note to append to it ("" for none)."""
        now = self.clock()
        with self._lock:
            state = self._keys.pop(key, None) or _Key()
            self._keys[key] = state
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            state.seen += 1
            if state.seen < self.burst:
                return ""
            if state.seen == self.burst:
                state.next_at = now + self.interval_s
                return f" [repeated {self.burst} times; from now on at most one line per {self.interval_s:g} s]"
            if now < state.next_at:
                state.suppressed += 1
                self.suppressed_total += 1
                return None
            state.next_at = now + self.interval_s
            dropped, state.suppressed = state.suppressed, 0
            return f" [{dropped} similar lines suppressed]" if dropped else ""

    def log(self, level: int, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """Logs ``msg % args`` unless throttled; returns whether it was logged."""
        note = self._admit(key)
        if note is None:
            return False
        self.logger.log(level, msg + note, *args, exc_info=exc_info)
        return True

    def warning(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def error(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)
