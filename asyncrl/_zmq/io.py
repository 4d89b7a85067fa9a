"""ZeroMQ machinery shared by the rollout and weight channels (private).

* :class:`IOThread`: the context, stop event, background thread and finalizer that every ZeroMQ end
  (:mod:`asyncrl.transport.zmq`, :mod:`asyncrl.weights.zmq`) owns. The thread owns
  its sockets; the owner's thread only sets the stop event. :meth:`IOThread.close` joins the thread and
  terminates the context once the thread has closed its sockets; a garbage-collected owner stops it too.
* :func:`drain`: receive what is ready without blocking.
* :func:`is_loopback_bind`: whether a bind stays on this machine (loopback TCP, ``ipc://``, ``inproc://``),
  the test behind "nobody in by default" on both channels.
"""

from __future__ import annotations

import ipaddress
import threading
import weakref
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq

__all__ = ["IOThread", "Waker", "drain", "is_loopback_bind"]

JOIN_S = 10.0
"""How long :meth:`IOThread.close` waits for the thread (which polls its stop event every few ms)."""


def drain(sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], object], limit: int) -> int:
    """Receives up to ``limit`` ready messages without blocking, passing each to ``handle``; returns the count."""
    for n in range(limit):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return n
        handle(frames)
    return limit


def is_loopback_bind(bind: str) -> bool:
    """True for ``ipc://``/``inproc://`` and for TCP on ``localhost`` or a loopback address."""
    if not bind.startswith("tcp://"):
        return True
    host = urlsplit(bind).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name, a hostname or "*": reachable from elsewhere
        return False


def _ignore(frames: object) -> None:
    pass


def _set(stop: threading.Event) -> None:
    stop.set()


class IOThread:
    """A ZeroMQ context, a stop event and the one thread that owns the owner's sockets.

    Args:
        owner: the object whose garbage collection stops the thread (it must not be referenced by ``target``
            through a strong reference cycle that outlives it; bound methods are fine: the thread ends first).
        name: the thread's name.
        context: whether the thread needs a ZeroMQ context (:attr:`ctx`); a thread without sockets does not.
    """

    def __init__(self, owner: object, name: str, *, context: bool = True):
        self.name = name
        self.ctx: zmq.Context | None = zmq.Context() if context else None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(owner, _set, self.stop)

    @property
    def started(self) -> bool:
        return self.thread is not None

    def start(self, target: Callable[[], None]) -> None:
        """Starts ``target`` (which returns once :attr:`stop` is set) in the background, once."""
        if self.thread is None:
            self.thread = threading.Thread(target=target, name=self.name, daemon=True)
            self.thread.start()

    def close(self, before_join: Callable[[], None] | None = None) -> bool:
        """Stops and joins the thread (not from the thread itself) and terminates the context once the thread
        has closed its sockets; returns whether it did. ``before_join`` runs after the stop event is set."""
        self.stop.set()
        if before_join is not None:
            before_join()
        joined = False
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=JOIN_S)
            joined = not self.thread.is_alive()
        if (joined or self.thread is None) and self.ctx is not None:
            self.ctx.term()
        self._finalizer()
        return joined or self.thread is None


class Waker:
    """An inproc wake-up pipe into an I/O thread's poller, so that work queued by another thread (a publish) goes
    out now rather than on the poller's next tick.

    The I/O side binds :meth:`pull` once and polls it with its other sockets (draining it with :func:`drain`); any
    other thread calls :meth:`wake`, which sends one empty frame unless a wake-up is already pending (it never
    blocks). :meth:`close` closes the sending end; call it before the context is terminated. A wake after close
    is a no-op (a background thread that outlived the I/O thread's join must not open a socket then: one made
    before the context's term would hang it, one after raises).

    With ``coalesce``, a wake while one is pending sends nothing at all (a thread that wakes per item costs a flag
    check, not a message, while the I/O thread is busy); the I/O side must then read the pipe with :meth:`drain`,
    which re-arms it, and do its work after that call.

    Args:
        ctx: the context of the I/O thread (inproc endpoints live in one context).
        name: a word for the endpoint's name.
        coalesce: send at most one wake-up until the I/O side drains it.
    """

    def __init__(self, ctx: zmq.Context, name: str, *, coalesce: bool = False):
        self.address = f"inproc://asyncrl-{name}-wake-{id(self):x}"
        self._ctx = ctx
        self._lock = threading.Lock()
        self._push: zmq.Socket | None = None  # the waking threads' end, made on first use, under _lock
        self._closed = False  # under _lock
        self._coalesce = coalesce
        self._pending = False  # under _lock: a coalesced wake-up sent and not drained yet

    def pull(self) -> zmq.Socket:
        """The I/O thread's end, bound (the caller closes it with its other sockets)."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def wake(self) -> None:
        with self._lock:
            if self._closed or self._pending:
                return
            if self._push is None:
                self._push = self._ctx.socket(zmq.PUSH)
                self._push.setsockopt(zmq.LINGER, 0)
                self._push.connect(self.address)
            try:
                self._push.send(b"", zmq.NOBLOCK)
                self._pending = self._coalesce
            except zmq.Again:  # a wake-up is already pending
                pass

    def drain(self, pull: zmq.Socket) -> None:
        """The I/O side: reads the wake-ups waiting in ``pull`` and re-arms :meth:`wake` (a wake from now on sends
        again); work the wakers asked for must be done after this call, so that none is missed."""
        drain(pull, _ignore, 1 << 20)
        with self._lock:
            self._pending = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._push is not None:
                self._push.close(linger=0)
                self._push = None
