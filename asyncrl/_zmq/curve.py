"""CURVE keys and the ZAP allow-list of the rollout channel (private to :mod:`~asyncrl.transport.zmq`).

A pool with CURVE authenticates workers by their public key: libzmq asks a ZAP handler at every CURVE
handshake, here ``zmq.auth``'s :class:`~zmq.auth.thread.ThreadAuthenticator` (its own thread, started
before the pool binds) with an :class:`AllowList` callback that admits the keys of ``transport.curve_allowed_keys``,
``transport.curve_allowed_keys_file`` (watched: changed at run time by rewriting it) and those authorized in process,
and counts the rest; a key revoked is refused from then on, at its next handshake and at its next message. A worker's own key pair comes from
``transport.curve_client_secret_key`` or ``transport.curve_client_key_file`` (``asyncrl worker
--client-key-file``); :func:`write_curve_key_file` makes one and returns the public key to list.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.config import TransportConfig

__all__ = [
    "AllowList",
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


class AllowList:
    """The worker public keys a CURVE socket admits, changeable while it runs.

    Three ways in, one set: ``transport.curve_allowed_keys`` (fixed), ``transport.curve_allowed_keys_file`` (watched:
    re-read when it changes, so a launcher authorizes a worker by rewriting the file before the worker starts, and
    revokes one by leaving its key out) and :meth:`authorize` / :meth:`revoke` (in process). A key revoked (by
    :meth:`revoke`, or by leaving the file) is refused from then on: at the next handshake by the ZAP callback, and
    at its next message by the socket's owner, which asks :meth:`admits` for the key libzmq stamped on the message
    (its ``User-Id``). A key the file names again is admitted again; one :meth:`revoke` named stays out until
    :meth:`authorize` names it.

    Thread-safe: the ZAP handler's thread calls :meth:`callback`, the socket's I/O thread :meth:`admits` and
    :meth:`refresh`, any thread :meth:`authorize` / :meth:`revoke`.
    """

    def __init__(self, keys: frozenset[str] | set[str] | list[str] = (), *, file: str | None = None,
                 count: Callable[[str], None] | None = None):
        self._lock = threading.Lock()
        self._fixed = set(keys)
        self._added: set[str] = set()
        self._revoked: set[str] = set()
        self._file = file
        self._file_keys: set[str] = set()
        self._file_stat: tuple[int, int, int] | None = None
        self.count: Callable[[str], None] = lambda name: None  # the first read is not counted (owner not built yet)
        self.version = 0
        """Moves whenever the admitted set may have shrunk: owners re-check their peers' keys when it moves."""
        if file is not None:
            self.refresh()
        self.count = count or self.count

    @classmethod
    def from_config(cls, config: TransportConfig, count: Callable[[str], None] | None = None) -> AllowList:
        return cls(config.curve_allowed_keys, file=config.curve_allowed_keys_file, count=count)

    def _admitted(self, key: str) -> bool:
        return key not in self._revoked and (key in self._fixed or key in self._added or key in self._file_keys)

    def refresh(self) -> bool:
        """Re-reads the watched file if it changed since the last read; returns whether it did. A file that
        vanished or cannot be parsed keeps the last keys read (logged), so a half-written edit never opens or shuts
        the door by accident (:func:`asyncrl.cluster.registry.write_allow_list` writes whole, then renames)."""
        if self._file is None:
            return False
        try:
            st = os.stat(self._file)
            stat = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stat == self._file_stat:
                return False
            keys = set(read_curve_keys_file(self._file))
        except (OSError, ValueError) as e:
            logging.getLogger(__name__).warning("allow-list file %s unreadable, keeping the last keys: %s",
                                                self._file, e)
            return False
        with self._lock:
            shrunk = bool(self._file_keys - keys)
            self._file_keys, self._file_stat = keys, stat
            if shrunk:
                self.version += 1
        self.count("allow_list_reloads")
        return True

    def admits(self, key: str) -> bool:
        """Whether ``key`` (Z85) is admitted now; a key not admitted is looked up again after re-reading a changed
        file (a worker authorized a moment ago is not refused for being quicker than the next refresh)."""
        with self._lock:
            if self._admitted(key):
                return True
        return self.refresh() and self.admits(key)

    def authorize(self, key: str) -> None:
        """Admits ``key`` from now on (undoes a :meth:`revoke` of it)."""
        if len(key) != 40:
            raise ValueError(f"a CURVE public key is 40 Z85 characters, got {len(key)}: {key[:60]!r}")
        with self._lock:
            self._revoked.discard(key)
            self._added.add(key)
        self.count("curve_keys_authorized")

    def revoke(self, key: str) -> None:
        """Refuses ``key`` from now on: new handshakes and every further message of a connection already made."""
        with self._lock:
            self._revoked.add(key)
            self._added.discard(key)
            self.version += 1
        self.count("curve_keys_revoked")

    def keys(self) -> frozenset[str]:
        with self._lock:
            return frozenset(k for k in self._fixed | self._added | self._file_keys if k not in self._revoked)

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP credentials provider (``zmq.auth``): called at every CURVE handshake."""
        ok = self.admits(key.decode("ascii", "replace"))
        self.count("curve_keys_admitted" if ok else "curve_keys_refused")
        return ok


def start_authenticator(ctx: zmq.Context, keys: AllowList | frozenset[str] | None,
                        count: Callable[[str], None]) -> Any:
    """Starts ``ctx``'s ZAP handler admitting the keys of ``keys`` (an :class:`AllowList`, changeable while it runs,
    or a fixed set counted with ``count``); None or an empty set: every key (``curve_allow_any_client``). Each
    handshake is counted ``curve_keys_admitted`` or ``curve_keys_refused``. Stop it with ``.stop()`` after the socket it
    guards is closed."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    if isinstance(keys, (frozenset, set)) and keys:
        keys = AllowList(keys, count=count)
    if isinstance(keys, AllowList):  # counts with its own ``count`` (the owner's, given when it was made)
        auth.configure_curve_callback("*", credentials_provider=keys)
    else:  # transport.curve_allow_any_client: encryption without client authentication
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    return auth
