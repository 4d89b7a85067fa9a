"""Two trainer ranks under torchrun (gloo): disjoint groups that together cover the epoch, with
workers serving both ranks and per-rank resume."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("_multirank_driver.py")


def test_two_ranks_disjoint_and_cover_epoch(tmp_path: Path):
    out = tmp_path / "ranks.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DRIVER), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    per_rank = [set(r["consumed"]) for r in ranks]
    assert all(len(r["consumed"]) == len(set(r["consumed"])) for r in ranks), "a rank consumed a group twice"
    assert per_rank[0].isdisjoint(per_rank[1])
    assert per_rank[0] | per_rank[1] == {f"e0-p{i}" for i in range(96)}
    assert [len(s) for s in per_rank] == [48, 48]
    assert ranks[0]["steps"] == ranks[1]["steps"], "lock-step DDP needs equal step counts"
    # M:N: workers started by either rank served both ranks
    served = collections.Counter(w for r in ranks for w in r["workers"])
    assert len(served) >= 2 and max(served.values()) == 2
