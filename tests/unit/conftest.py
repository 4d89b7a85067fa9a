"""The unit tier's rule, as a mechanism: a test under ``tests/unit/`` spawns no process and opens no socket.

While any unit test runs (its fixtures included), opening a socket (``socket.socket``, hence every library built on
it; ``socket.socketpair``, an unnamed in-process pair such as asyncio's wake-up pipe, stays allowed), a ZeroMQ context
or socket, a process (``subprocess.Popen`` and everything built on it,
``os.fork``/``os.posix_spawn``/``os.system``, any ``multiprocessing`` start method, ``torch.multiprocessing.spawn``) or a
``torch.distributed`` process group raises :class:`UnitTierViolation` with a message naming the call and saying where
the test belongs. A violation that the code under test catches and swallows is still recorded, and the test fails at
teardown: a unit test cannot pass while breaking the rule.

Why: the unit tier is the fast, hermetic one (``pytest tests/unit`` in about two minutes on 2 cores, no ports, no
leftover processes). Tests that need real processes, sockets or process groups live in ``tests/integration/``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import pytest

MOVE = "move this test to tests/integration (tests/unit spawns no process and opens no socket)"


class UnitTierViolation(RuntimeError):
    """A unit test tried to spawn a process or open a socket."""


_violations: list[str] = []


def _refuse(what: str):
    def refuse(*args, **kwargs):
        message = f"{what} called in a unit test: {MOVE}"
        _violations.append(message)
        raise UnitTierViolation(message)

    return refuse


_socket_init = socket.socket.__init__


def _socket_init_wrapping_only(self, family=-1, type=-1, proto=-1, fileno=None):
    """``socket.socket()`` may only wrap a descriptor that already exists (what ``socket.socketpair`` hands back: an
    unnamed in-process pair, asyncio's wake-up pipe); opening a new socket is refused."""
    if fileno is None:
        _refuse("socket.socket()")()
    _socket_init(self, family, type, proto, fileno)


def _guarded_targets() -> list[tuple[object, str, str]]:
    """(owner, attribute, what) for every entry point the unit tier refuses."""
    import zmq

    targets: list[tuple[object, str, str]] = [
        (socket, "create_connection", "socket.create_connection()"),
        (socket, "create_server", "socket.create_server()"),
        (zmq.Context, "__init__", "zmq.Context()"),
        (zmq.Socket, "__init__", "zmq.Socket()"),
        (subprocess.Popen, "__init__", "subprocess.Popen()"),
        (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start()"),
        (os, "fork", "os.fork()"),
        (os, "forkpty", "os.forkpty()"),
        (os, "posix_spawn", "os.posix_spawn()"),
        (os, "posix_spawnp", "os.posix_spawnp()"),
        (os, "system", "os.system()"),
    ]
    try:
        import torch.distributed as dist
    except ImportError:  # a torch without distributed support: nothing to guard
        return targets
    if dist.is_available():
        targets.append((dist, "init_process_group", "torch.distributed.init_process_group()"))
        targets.append((dist, "TCPStore", "torch.distributed.TCPStore()"))
    return targets


@pytest.fixture(scope="package", autouse=True)
def _no_process_no_socket():
    """Installed once for the whole unit tier (so module- and class-scoped fixtures are covered too), removed after
    its last test, before any integration test runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "__init__", _socket_init_wrapping_only)
        for owner, name, what in _guarded_targets():
            if hasattr(owner, name):
                patch.setattr(owner, name, _refuse(what))
        yield


@pytest.fixture(autouse=True)
def _fail_on_swallowed_violation(_no_process_no_socket):
    """Fail a test whose code caught the :class:`UnitTierViolation` and went on."""
    _violations.clear()
    yield
    if _violations:
        seen = list(dict.fromkeys(_violations))
        _violations.clear()
        pytest.fail("\n".join(seen), pytrace=False)
