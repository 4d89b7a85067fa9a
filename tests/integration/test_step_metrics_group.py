"""Step metrics under a real (one-rank gloo) process group: no collective at world size one."""

from __future__ import annotations

import pytest
import torch

from asyncrl.train.step_metrics import batch_stats

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


def test_batch_stats_and_ddp_at_world_size_one_use_no_collective(tmp_path, monkeypatch):
    """At world size 1 (the recipe on one rank) the statistics are the rank's own and the policy trains unwrapped:
    no all-reduce per step, no DDP hooks in backward (both cost the TRL comparison's 1-rank step time)."""
    import torch.distributed as dist

    from asyncrl.train.parallel import parallelize

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def refuse(*_, **__):
            raise AssertionError("a collective at world size 1")

        monkeypatch.setattr(dist, "all_reduce", refuse)
        got = batch_stats(torch.tensor([1.0, float("nan"), 0.5, 0.5]), torch.tensor([0.0, 1.0, 1.0, 20.0]), 123,
                          torch.device("cpu"))
        assert got["reward_mean"] == 0.5 and got["staleness_max"] == 20.0 and got["tokens"] == 123.0
        assert got["staleness_hist"][:2] == [1, 2] and sum(got["staleness_hist"]) == 4
        policy = torch.nn.Linear(2, 2)
        assert parallelize(policy, "ddp", torch.device("cpu")) is policy
        with pytest.raises(ValueError, match="must be 'ddp' or 'fsdp2'"):
            parallelize(policy, "tp", torch.device("cpu"))
    finally:
        dist.destroy_process_group()
