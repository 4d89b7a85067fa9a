"""asyncrl.check._ranks.launch_ranks: real gloo ranks with torchrun's environment, the store on port 0 in the
launcher; a rank that dies ends the others at once (they would wait for it in the rendezvous until the deadline)."""

from __future__ import annotations

import time

import pytest

from asyncrl.check._ranks import launch_ranks

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)

_SCRIPT = """
import os, sys
if os.environ["RANK"] == "1" and sys.argv[1] == "die":
    sys.exit(3)  # before the rendezvous: rank 0 waits for it there
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(int(t.item()), os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
dist.destroy_process_group()
"""


def test_launch_ranks_runs_a_gloo_group_and_ends_the_ranks_when_one_dies(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_SCRIPT)
    results = launch_ranks([str(script), "ok"], 2, timeout_s=300)
    assert [r.returncode for r in results] == [0, 0], [r.tail() for r in results]
    assert [r.stdout.split() for r in results] == [["3", "2", "0"], ["3", "2", "1"]]

    t0 = time.monotonic()
    results = launch_ranks([str(script), "die"], 2, timeout_s=300)
    assert results[1].returncode == 3 and results[0].returncode == -9  # ended by the launcher, not the deadline
    assert time.monotonic() - t0 < 250
