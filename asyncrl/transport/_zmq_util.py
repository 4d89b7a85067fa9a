"""Small ZeroMQ helpers shared by the rollout and weight channels."""

from __future__ import annotations

from collections.abc import Callable

import zmq

__all__ = ["drain"]


def drain(sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], object], limit: int) -> int:
    """Receives up to ``limit`` ready messages without blocking, passing each to ``handle``; returns the count."""
    for n in range(limit):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return n
        handle(frames)
    return limit
