"""Transports between processes: the rollout channel (workers ↔ pool)."""

from asyncrl.transport.base import (
    HandshakeTimeout,
    PeerLost,
    ReceivedLease,
    RolloutReceiver,
    RolloutSender,
    setup_rollout_receiver,
    setup_rollout_sender,
)

__all__ = [
    "HandshakeTimeout",
    "PeerLost",
    "ReceivedLease",
    "RolloutReceiver",
    "RolloutSender",
    "setup_rollout_receiver",
    "setup_rollout_sender",
]
