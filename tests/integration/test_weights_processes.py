"""Weight sync across processes: a receiver SIGKILLed mid-transfer never commits, the other one does.

The broadcaster lives in the test process; two receiver processes (``_weights_driver.py``) first
stage and commit a small version 1, then version 2 (64 MiB in ~60 buckets of 1 MiB). The victim fetches
with ``window=1`` and a delay per bucket and is killed once it has received part of version 2.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from asyncrl.weights import setup_weight_broadcaster
from asyncrl.weights._staging import tensor_bytes

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("_weights_driver.py")
MB = 1 << 20
TIMEOUT_S = 90.0


def big_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    layers = {f"layers.{i}.mlp.weight": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(60)}
    return {**layers, "embed.weight": torch.randn(1024, 1024, generator=g), "bias": torch.arange(1000)}


def crcs(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: zlib.crc32(tensor_bytes(t)) for name, t in tensors.items()}


class Driver:
    """One receiver process; a reader thread queues its stdout lines (events)."""

    def __init__(self, backend: str, address: str, receiver_id: str, log: Path, *extra: str):
        argv = [sys.executable, str(DRIVER), backend, address, receiver_id, "--versions", "1,2", *extra]
        self.log = log
        with open(log, "w") as err:  # a file, not a pipe: a chatty driver never blocks on stderr
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        self.events: list[dict] = []
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:  # select() on a buffered pipe would miss lines already read into the buffer
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def next_event(self, until: float) -> dict:
        try:
            line = self.lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGUSR1)  # the driver dumps its threads' stacks to its log
                time.sleep(0.5)
            raise AssertionError(f"driver timed out after {self.events[-3:]}; log: {self.log.read_text()[-4000:]}")
        if not line:
            raise AssertionError(f"driver exited {self.proc.wait()}: {self.log.read_text()[-2000:]}")
        self.events.append(json.loads(line))
        return self.events[-1]

    def until(self, event: str, deadline: float, **match) -> dict:
        while True:
            e = self.next_event(deadline)
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_receiver_killed_mid_transfer_never_commits(backend, tmp_path):
    deadline = time.monotonic() + TIMEOUT_S
    b = setup_weight_broadcaster(backend, bucket_bytes=MB)
    survivor = victim = None
    try:
        v1 = {"w": torch.ones(16)}
        b.publish(v1, 1)
        survivor = Driver(backend, b.address, "survivor", tmp_path / "survivor.log")
        victim = Driver(backend, b.address, "victim", tmp_path / "victim.log", "--window", "1", "--delay", "0.05")
        for d in (survivor, victim):
            d.until("committed", deadline, version=1)
        assert_eventually(lambda: b.committed() == {"survivor": 1, "victim": 1}, deadline)

        v2 = big_state_dict()
        stats = b.publish(v2, 2)
        assert stats["bytes"] >= 64 * MB and stats["buckets"] >= 60
        progress = victim.until("progress", deadline, version=2)
        while progress["bytes"] < 4 * MB:  # a few buckets in, far from done
            progress = victim.until("progress", deadline, version=2)
        assert progress["bytes"] < stats["bytes"] // 2
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.wait(10) == -signal.SIGKILL

        staged = survivor.until("staged", deadline, version=2)
        assert staged["checksums"] == crcs(v2)
        survivor.until("committed", deadline, version=2)
        assert survivor.proc.wait(20) == 0, survivor.log.read_text()[-2000:]
        assert_eventually(lambda: b.committed().get("survivor") == 2, deadline)
        assert b.committed() == {"survivor": 2, "victim": 1}  # the victim never reached phase two of v2
        b.publish({"w": torch.zeros(16)}, 3)  # a dead receiver does not wedge the broadcaster
        if backend == "shm":  # the kernel dropped the dead receiver's hold on its slot: nothing waited or replaced
            assert b.stats()["slots_replaced"] == 0, b.stats()
    finally:
        for d in (survivor, victim):
            if d is not None:
                d.stop()
        b.close()


def assert_eventually(check, deadline: float) -> None:
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
