"""The rollout channel (workers <-> a trainer rank's pool): one abstract base per direction (``base.py``), the wire
protocol (``protocol.py``), the ZeroMQ backend with both ends (``zmq.py``), and the factories that pick it.

CURVE keys for a non-loopback pool: :func:`generate_curve_keys`, :func:`write_curve_key_file` (shared with the weight
channel, ``asyncrl._zmq.curve``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from asyncrl._zmq.curve import generate_curve_keys, write_curve_key_file
from asyncrl.config import GateConfig, TransportConfig
from asyncrl.pool.buffer import RolloutPool
from asyncrl.transport.base import HandshakeTimeout, PeerLost, ReceivedLease, RolloutReceiver, RolloutSender
from asyncrl.transport.zmq import ZmqRolloutReceiver, ZmqRolloutSender

__all__ = [
    "HandshakeTimeout",
    "PeerLost",
    "ReceivedLease",
    "RolloutReceiver",
    "RolloutSender",
    "generate_curve_keys",
    "setup_rollout_receiver",
    "setup_rollout_sender",
    "write_curve_key_file",
]


def setup_rollout_receiver(
    config: TransportConfig,
    pool: RolloutPool,
    prompt_fn: Callable[[int], Any],
    *,
    rank: int = 0,
    world_size: int = 1,
    gate: GateConfig | None = None,
) -> RolloutReceiver:
    """The receiver for ``config``; ``gate`` is what it admits from workers (ranges, per-peer caps)."""
    return ZmqRolloutReceiver(config, pool, prompt_fn, rank=rank, world_size=world_size, gate=gate)


def setup_rollout_sender(
    config: TransportConfig,
    endpoints: Sequence[str],
    *,
    worker_id: str,
    slots: int,
    server_key: str | None = None,
    streaming: bool = False,
    ready: bool = True,
) -> RolloutSender:
    """The sender of a worker serving the pools at ``endpoints`` (one per trainer rank), ``slots`` credits each;
    ``ready=False``: the pools greet it but grant it nothing until ``set_ready()``."""
    return ZmqRolloutSender(config, endpoints, worker_id=worker_id, slots=slots, server_key=server_key,
                            streaming=streaming, ready=ready)
