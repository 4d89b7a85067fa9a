"""CURVE keys and the ZAP allow-list of the rollout channel (private to :mod:`~asyncrl.transport.zmq`).

A pool with CURVE authenticates workers by their public key: libzmq asks a ZAP handler at every CURVE
handshake, here ``zmq.auth``'s :class:`~zmq.auth.thread.ThreadAuthenticator` (its own thread, started
before the pool binds) with a callback that admits the keys of ``transport.curve_allowed_keys`` and
``transport.curve_allowed_keys_file`` and counts the rest. A worker's own key pair comes from
``transport.curve_client_secret_key`` or ``transport.curve_client_key_file`` (``asyncrl worker
--client-key-file``); :func:`write_curve_key_file` makes one and returns the public key to list.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.config import TransportConfig

__all__ = [
    "allowed_keys",
    "client_secret_key",
    "generate_curve_keys",
    "read_curve_keys_file",
    "start_authenticator",
    "write_curve_key_file",
]


def generate_curve_keys() -> tuple[str, str]:
    """A new CURVE ``(public, secret)`` key pair, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def write_curve_key_file(path: str) -> str:
    """Writes a new CURVE secret key to ``path`` (mode 0600, for ``transport.curve_client_key_file`` or
    ``asyncrl worker --client-key-file``); returns its public key, the one to put in the pool's allow-list."""
    public, secret = generate_curve_keys()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"# asyncrl worker CURVE secret key; public key: {public}\n{secret}\n")
    return public


def read_curve_keys_file(path: str) -> list[str]:
    """The Z85 keys of a key file: one 40-character key per line; blank lines and comment lines (starting
    with ``#`` and not a key: Z85 itself uses ``#``) are ignored.

    Raises:
        ValueError: naming the file and line of a line that is neither a key nor a comment.
    """
    keys = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            key = line.strip()
            if len(key) == 40 and not any(c.isspace() for c in key):
                keys.append(key)
            elif key and not key.startswith("#"):
                raise ValueError(f"{path}:{n}: a CURVE key is 40 Z85 characters, got {len(key)}: {key[:60]!r}")
    return keys


def client_secret_key(config: TransportConfig) -> str | None:
    if config.curve_client_secret_key is not None:
        return config.curve_client_secret_key
    if config.curve_client_key_file is not None:
        keys = read_curve_keys_file(config.curve_client_key_file)
        if not keys:
            raise ValueError(f"transport.curve_client_key_file={config.curve_client_key_file!r} holds no key")
        return keys[0]
    return None


def allowed_keys(config: TransportConfig) -> frozenset[str]:
    keys = list(config.curve_allowed_keys)
    if config.curve_allowed_keys_file is not None:
        keys += read_curve_keys_file(config.curve_allowed_keys_file)
    return frozenset(keys)


class _AllowList:
    """ZAP credentials provider (``zmq.auth``): admits the listed CURVE client keys, counts the rest."""

    def __init__(self, keys: frozenset[str], count: Callable[[str], None]):
        self.keys = keys
        self.count = count

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key.decode("ascii", "replace") in self.keys
        self.count("curve_keys_admitted" if ok else "curve_keys_refused")
        return ok


def start_authenticator(ctx: zmq.Context, keys: frozenset[str], count: Callable[[str], None]) -> Any:
    """Starts ``ctx``'s ZAP handler admitting ``keys`` (every key when empty: ``curve_allow_any_client``);
    ``count(name)`` is called with ``curve_keys_admitted`` / ``curve_keys_refused`` per handshake. Stop it
    with ``.stop()`` after the socket it guards is closed."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    if keys:
        auth.configure_curve_callback("*", credentials_provider=_AllowList(keys, count))
    else:  # transport.curve_allow_any_client: encryption without client authentication
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    return auth
