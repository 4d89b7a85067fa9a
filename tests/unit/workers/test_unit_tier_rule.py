"""The unit tier's rule is a mechanism (``tests/unit/conftest.py``): inside ``tests/unit`` (this subpackage too),
every way to open a socket or start a process raises, naming where the test belongs, and a violation the code under
test swallows still fails the test."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
import zmq

from tests.unit import conftest


def _spawn_child() -> None:
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=print).start()


CALLS = {
    "socket": lambda: socket.socket(),
    "socket AF_UNIX": lambda: socket.socket(socket.AF_UNIX),
    "create_connection": lambda: socket.create_connection(("127.0.0.1", 9)),
    "zmq.Context": lambda: zmq.Context(),
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"]),
    "multiprocessing spawn": _spawn_child,
    "os.fork": lambda: os.fork(),
    "os.system": lambda: os.system("true"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_sockets_and_processes_raise_naming_the_integration_tier(call):
    with pytest.raises(conftest.UnitTierViolation, match="move this test to tests/integration"):
        CALLS[call]()
    assert conftest._violations  # recorded: had the code under test swallowed it, teardown would fail the test
    conftest._violations.clear()  # this test expects the violation


def test_a_process_group_is_refused():
    import torch.distributed as dist

    with pytest.raises(conftest.UnitTierViolation, match="init_process_group"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    conftest._violations.clear()


def test_an_in_process_socketpair_and_so_an_asyncio_loop_are_allowed():
    import asyncio

    a, b = socket.socketpair()  # unnamed, in-process: asyncio's wake-up pipe
    a.close()
    b.close()
    assert asyncio.run(asyncio.sleep(0, result=7)) == 7
    assert not conftest._violations
