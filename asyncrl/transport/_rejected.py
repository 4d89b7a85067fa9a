"""The rollouts a pool refused, kept for the debugger (private to :mod:`asyncrl.transport.zmq`).

When the gate refuses a group, or one of its rollouts fails validation, the receiver keeps copies of the offending
rollouts as they arrived on the wire (the last :data:`KEEP_REJECTED`, each at most :data:`KEEP_REJECTED_BYTES`), so
the debugger can dump what was refused. The receiver's I/O thread keeps them; any thread reads them. Nothing blocks
but a short lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from asyncrl.codec import DecodeError
from asyncrl.pool.gate import GateError
from asyncrl.rollout import Rollout

__all__ = ["KEEP_REJECTED", "KEEP_REJECTED_BYTES", "RejectedRollouts"]

KEEP_REJECTED = 4
"""Rollouts refused by validation kept for the debugger (the last few, each at most KEEP_REJECTED_BYTES)."""
KEEP_REJECTED_BYTES = 1 << 20


class RejectedRollouts:
    """A bounded, thread-safe record of the last refused rollouts: ``{"worker", "error", "rollout"}`` each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_REJECTED)

    def keep(self, worker_id: str | None, group: Any, error: GateError | None = None) -> None:
        """Keeps copies of the (small) rollouts of a refused group (its wire dict): the one the gate named, or those
        that fail validation themselves."""
        rollouts = group.get("rollouts") if isinstance(group, dict) else None
        for d in rollouts if isinstance(rollouts, list) else ():
            if not isinstance(d, dict):
                continue
            if error is not None:
                if d.get("uid") != error.uid:
                    continue
                reason: Exception = error
            else:
                try:
                    Rollout.from_wire(d)
                    continue
                except DecodeError as e:
                    reason = e
            tensors = [v for v in d.values() if hasattr(v, "nbytes")]
            if sum(t.nbytes for t in tensors) <= KEEP_REJECTED_BYTES:
                kept = {k: v.clone() if hasattr(v, "clone") else v for k, v in d.items()}
                with self._lock:
                    self._kept.append({"worker": worker_id, "error": str(reason)[:300], "rollout": kept})

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._kept)
