"""The ``transport`` section: the ZeroMQ rollout channel between workers and a trainer rank's pool.

Its CURVE settings also secure the ``zmq`` weight channel (``asyncrl.weights.start``). Plain data: nothing here
blocks or starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TransportConfig"]


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """The ZeroMQ link between workers and a trainer rank's pool."""

    bind: str = "tcp://127.0.0.1:0"
    """Where the pool binds: ``tcp://HOST:PORT`` (port 0 picks a free one) or ``ipc:///path``. Loopback by
    default; a non-loopback host needs ``curve_secret_key`` or ``allow_insecure_remote``."""
    heartbeat_s: float = 1.0
    """Both ends send a heartbeat this often when otherwise idle."""
    peer_timeout_s: float = 10.0
    """A peer silent for this long is dead: the pool re-issues its leases, a worker gives up on the pool."""
    handshake_timeout_s: float = 60.0
    """A worker that gets no WELCOME from the pool within this long exits with an error naming this setting."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest message accepted; larger ones are rejected and counted (ZeroMQ also drops peers whose single
    frame is larger)."""
    hwm: int = 1000
    """ZeroMQ high-water mark (messages per peer)."""
    curve_secret_key: str | None = None
    """Z85 CURVE secret key of the pool; enables encryption and authentication of workers."""
    curve_public_key: str | None = None
    """Z85 CURVE public key of the pool (workers need it as ``server_key``)."""
    allow_insecure_remote: bool = False
    """Allow binding a non-loopback address without CURVE (trusted networks only)."""
    curve_allowed_keys: list[str] = field(default_factory=list)
    """Pool side: Z85 CURVE public keys of the workers admitted (ZAP allow-list). With CURVE on, a worker
    whose key is in neither this list nor ``curve_allowed_keys_file`` is refused at the handshake (counted)."""
    curve_allowed_keys_file: str | None = None
    """Pool side: a file of admitted worker public keys, one Z85 key per line (``#`` comments allowed); read
    at start-up, added to ``curve_allowed_keys``."""
    curve_allow_any_client: bool = False
    """Pool side: with CURVE on and no allow-list, serve any client key (encryption without client
    authentication). Off by default: such a pool is refused at construction."""
    curve_client_secret_key: str | None = None
    """Worker side: this worker's own Z85 CURVE secret key (its public key, derived from it, is what the pool's
    allow-list names). None: ``curve_client_key_file``, else a throw-away key pair (refused by an allow-list)."""
    curve_client_key_file: str | None = None
    """Worker side: a file holding this worker's Z85 secret key (first non-comment line), as written by
    ``asyncrl.transport.zmq.write_curve_key_file``."""

    def __post_init__(self):
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"transport.bind={self.bind!r} must start with tcp://, ipc:// or inproc://")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(f"{self.peer_timeout_s=} must exceed {self.heartbeat_s=} (several heartbeats per timeout)")
        if (self.curve_secret_key is None) != (self.curve_public_key is None):
            raise ValueError("set both transport.curve_secret_key and transport.curve_public_key, or neither")
        for key in [*self.curve_allowed_keys, *filter(None, [self.curve_client_secret_key])]:
            if not isinstance(key, str) or len(key) != 40:
                raise ValueError(f"CURVE keys are 40-character Z85 strings; got {key!r:.60} in transport settings")
