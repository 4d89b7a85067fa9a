"""Delta updates with real receiver processes over loopback tcp: a receiver that committed the previous version
gets deltas, a late joiner gets full buckets and then deltas, both end bit for bit on every version, and the
bytes on the wire are counted on both ends (``delta_bytes``/``full_bytes``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from asyncrl.weights import setup_weight_broadcaster
from asyncrl.weights._staging import tensor_bytes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DRIVER = Path(__file__).with_name("_delta_driver.py")
MB = 1 << 20
TIMEOUT_S = 90.0


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {f"layers.{i}.mlp.weight": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16) for i in range(8)}
    return {**w, "norm.weight": torch.ones(1024)}


def adamw_step(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """One real AdamW step at lr 1e-6 with random gradients (on bf16 weights: most elements keep their bits)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        p = torch.nn.Parameter(t.clone())
        p.grad = torch.randn(t.shape, generator=g).to(t.dtype)
        torch.optim.AdamW([p], lr=1e-6).step()
        out[name] = p.detach()
    return out


def crcs(tensors):
    return {name: zlib.crc32(tensor_bytes(t)) for name, t in tensors.items()}


class Receiver:
    def __init__(self, address: str, receiver_id: str, versions: str, log: Path):
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(DRIVER), address, receiver_id, "--versions", versions],
                                         stdout=subprocess.PIPE, stderr=err, text=True)

    def until(self, event: str, **match) -> dict:
        for line in self.proc.stdout:  # the driver ends every wait with a line (or exits): no hang here
            e = json.loads(line)
            assert e["event"] != "timeout", e
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e
        raise AssertionError(f"driver exited {self.proc.wait()}: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_deltas_to_receiver_processes_and_a_late_joiner(tmp_path):
    v = [model()]
    for seed in (1, 2):
        v.append(adamw_step(v[-1], seed))
    b = setup_weight_broadcaster("zmq", bucket_bytes=MB, delta=True)
    early = late = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        b.publish(v[0], 1)
        early = Receiver(b.address, "early", "1,2,3", tmp_path / "early.log")
        assert early.until("staged", version=1)["checksums"] == crcs(v[0])
        early.until("committed", version=1)
        while b.committed().get("early") != 1:  # the delta for version 2 is made against what it committed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.publish(v[1], 2)
        assert early.until("staged", version=2)["checksums"] == crcs(v[1])
        late = Receiver(b.address, "late", "2,3", tmp_path / "late.log")
        assert late.until("staged", version=2)["checksums"] == crcs(v[1])
        for r in (early, late):
            r.until("committed", version=2)
        while b.committed() != {"early": 2, "late": 2}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.publish(v[2], 3)
        stats = {}
        for name, r in (("early", early), ("late", late)):
            assert r.until("staged", version=3)["checksums"] == crcs(v[2])
            stats[name] = r.until("stats")["stats"]
            assert r.proc.wait(20) == 0
    finally:
        for r in (early, late):
            if r is not None:
                r.stop()
        served = b.stats()
        b.close()
    nbytes = sum(t.nbytes for t in v[0].values())
    # early: version 1 full, 2 and 3 as deltas; late: version 2 full (no base), 3 as deltas
    assert stats["early"]["full_bytes"] < 1.2 * nbytes and stats["early"]["buckets_delta"] > 0
    assert nbytes <= stats["late"]["full_bytes"] < 1.2 * nbytes and stats["late"]["buckets_delta"] > 0
    for s in stats.values():
        assert s["delta_refused"] == 0 and s["failures"] == 0
        assert s["delta_bytes"] * 10 < nbytes, s  # one tiny AdamW step on bf16: far fewer bytes
    wire = sum(s["full_bytes"] + s["delta_bytes"] for s in stats.values())
    assert served["bytes_served"] == wire == served["full_bytes"] + served["delta_bytes"]
