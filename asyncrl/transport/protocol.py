"""The rollout channel's wire protocol: message kinds and the checks on their bodies.

Worker → pool: ``HELLO`` (register, with its credits; optional ``streaming: true``: grant each free credit at
once; optional ``ready: false``: greet, but grant nothing until a later HELLO without it; a HELLO from a worker
already registered on that connection refreshes it), ``GROUP`` (one finished group for a lease),
``FAILED`` (a lease it could not finish; optional ``culprit``: what failed, ``reward``, ``engine``, ``decode``,
``environment`` or ``worker``), ``HEARTBEAT``, ``BYE``.
Pool → worker: ``WELCOME`` (handshake reply), ``LEASES`` (prompts to generate = credits granted),
``HEARTBEAT`` (carries the trainer's policy version), ``CANCEL`` (drop queued leases older than its
``min_lease_id``: the pool was reset), ``RESYNC`` (the pool forgot you; say HELLO again), ``SHUTDOWN``
(a worker answers BYE, which the closing pool waits for).

Every body is a msgpack map checked here; a violation is a :class:`~asyncrl.codec.DecodeError`.
"""

from __future__ import annotations

from typing import Any

from asyncrl.codec import DecodeError

__all__ = [
    "BYE",
    "CANCEL",
    "FAILED",
    "GROUP",
    "HEARTBEAT",
    "HELLO",
    "LEASES",
    "POOL_KINDS",
    "PROTOCOL_VERSION",
    "RESYNC",
    "SHUTDOWN",
    "WELCOME",
    "WORKER_KINDS",
    "check_body",
    "check_fields",
]

PROTOCOL_VERSION = 1

HELLO = "hello"
GROUP = "group"
FAILED = "failed"
HEARTBEAT = "heartbeat"
BYE = "bye"
WELCOME = "welcome"
LEASES = "leases"
CANCEL = "cancel"
RESYNC = "resync"
SHUTDOWN = "shutdown"

WORKER_KINDS = frozenset({HELLO, GROUP, FAILED, HEARTBEAT, BYE})
"""Kinds a pool accepts from workers."""
POOL_KINDS = frozenset({WELCOME, LEASES, HEARTBEAT, CANCEL, RESYNC, SHUTDOWN})
"""Kinds a worker accepts from a pool."""

_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    HELLO: {"worker_id": str, "slots": int, "pid": int, "host": str, "protocol": int},
    GROUP: {"lease_id": int, "group": dict},
    FAILED: {"lease_id": int, "error": str},
    HEARTBEAT: {},
    BYE: {},
    WELCOME: {"rank": int, "world_size": int, "group_size": int, "heartbeat_s": (int, float), "policy_version": int},
    LEASES: {"policy_version": int, "leases": list},
    CANCEL: {},
    RESYNC: {},
    SHUTDOWN: {},
}


def check_fields(
    kind: str, body: Any, allowed: frozenset[str], required: dict[str, dict[str, type | tuple[type, ...]]], what: str
) -> dict[str, Any]:
    """Checks that ``kind`` is allowed on this side and ``body`` has its required, well-typed fields
    (``required[kind]``: field -> type); shared by every channel's protocol. A bool is never an int here.

    Raises:
        DecodeError: naming the kind and field.
    """
    if kind not in allowed:
        raise DecodeError(f"unexpected {what} kind {kind!r:.40}; this side accepts {sorted(allowed)}")
    if not isinstance(body, dict):
        raise DecodeError(f"{kind} body must be a map, got {type(body).__name__}")
    for key, typ in required[kind].items():
        value = body.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise DecodeError(f"{kind}.{key} must be {typ}, got {type(value).__name__}")
    return body


def check_body(kind: str, body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """Checks a rollout-channel message: its fields (:func:`check_fields`) and HELLO's values.

    Raises:
        DecodeError: naming the kind and field.
    """
    check_fields(kind, body, allowed, _REQUIRED, "message")
    if kind == CANCEL and not isinstance(body.get("min_lease_id", 0), int):
        raise DecodeError(f"cancel.min_lease_id must be an int, got {type(body['min_lease_id']).__name__}")
    if kind == HELLO:
        if not 1 <= body["slots"] <= 1 << 16 or not body["worker_id"] or len(body["worker_id"]) > 128:
            raise DecodeError(f"hello: slots must be in [1, 65536] and worker_id 1..128 chars, got {body!r:.200}")
        if body["protocol"] != PROTOCOL_VERSION:
            raise DecodeError(f"worker speaks protocol {body['protocol']}, pool speaks {PROTOCOL_VERSION}; upgrade")
    return body
