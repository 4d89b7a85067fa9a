"""The two ends of the rollout channel, one abstract base per direction.

``RolloutReceiver`` runs on the trainer side next to a :class:`~asyncrl.pool.buffer.RolloutPool`: it accepts
workers, grants them leases against the pool's capacity (credit-based flow control), receives their
groups and re-issues the leases of workers that die. ``RolloutSender`` runs in a worker process: it
handshakes with one or more pools, queues the leases they grant and sends finished groups back on
the connection each lease came from. One backend file implements both ends of its wire protocol
(``zmq.py``); :func:`asyncrl.transport.setup_rollout_receiver` / :func:`~asyncrl.transport.setup_rollout_sender` pick
it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from asyncrl.rollout import Group

__all__ = [
    "HandshakeTimeout",
    "PeerLost",
    "ReceivedLease",
    "RolloutReceiver",
    "RolloutSender",
]


class HandshakeTimeout(TimeoutError):
    """A worker got no WELCOME from a pool in time (``transport.handshake_timeout_s``)."""


class PeerLost(ConnectionError):
    """The other end stopped answering for longer than ``transport.peer_timeout_s``."""


@dataclass(kw_only=True, slots=True)
class ReceivedLease:
    """A lease as a worker sees it."""

    conn: int
    """Which pool connection it came from (send the group back there)."""
    lease_id: int
    epoch: int
    prompt_index: int
    group_size: int
    prompt: Any
    policy_version: int
    """The trainer's policy version when the lease was granted."""
    incarnation: str = ""
    """The trainer incarnation that granted it (:mod:`asyncrl.pool.timeline`): generate with its weights."""


class RolloutReceiver(abc.ABC):
    """Trainer-side end: serves workers for one pool."""

    @abc.abstractmethod
    def start(self) -> str:
        """Starts serving; returns the endpoint workers connect to (the real port when bound to 0)."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str: ...

    @abc.abstractmethod
    def cancel_all(self) -> None:
        """Tells every worker to drop the leases it queued (the pool was reset)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: messages, bad frames, refusals by reason (``not_leased_to_peer``, ``gate_*``,
        ``hello_refused_*``, ``curve_keys_refused``), workers joined/lost, connections dropped; ``workers``."""

    def ready_workers(self) -> int:
        """Workers that serve this pool now: greeted, alive and holding the trainer's weights (a worker still waiting
        for them is not counted). The pool node's fleet floor (``rollout.min_workers``) compares it."""
        return sum(w.get("ready", True) is not False for w in self.stats().get("workers", {}).values())

    def rejected_rollouts(self) -> list[dict[str, Any]]:
        """The last few rollouts refused by validation: ``{"worker", "error", "rollout"}`` with the wire dict
        as received (for the debugger's dumps). Backends that keep none return []."""
        return []

    @abc.abstractmethod
    def close(self, shutdown_workers: bool = True) -> None: ...


class RolloutSender(abc.ABC):
    """Worker-side end: receives leases from pools, sends groups back."""

    status: dict[str, int | float | str]
    """Small flat dict the worker keeps current (policy version, failures); pools see it in their stats."""

    @abc.abstractmethod
    def start(self) -> None:
        """Connects and handshakes with every pool.

        Raises:
            HandshakeTimeout: naming ``transport.handshake_timeout_s``.
        """

    @abc.abstractmethod
    def take_leases(self, max_leases: int, timeout: float) -> list[ReceivedLease]:
        """Up to ``max_leases`` queued leases, waiting at most ``timeout`` seconds for the first.

        Raises:
            PeerLost: if every pool went silent.
        """

    @abc.abstractmethod
    def send_group(self, lease: ReceivedLease, group: Group) -> None: ...

    @abc.abstractmethod
    def send_failed(self, lease: ReceivedLease, error: str, culprit: str | None = None) -> None:
        """Reports a lease the worker could not finish: the error's text and what failed (``culprit``: a key of
        :data:`asyncrl.pool.poison.CULPRITS`: ``reward``, ``engine``, ``decode``, ``environment``, ``worker``)."""

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """True once every pool said SHUTDOWN."""

    @abc.abstractmethod
    def set_ready(self) -> None:
        """A sender built with ``ready=False`` (greeted, but granted no lease: its worker is still waiting for the
        trainer's weights) now takes leases."""

    @abc.abstractmethod
    def close(self) -> None: ...
