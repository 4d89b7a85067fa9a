"""The recipe resumed at another number of trainer ranks, both ways: mid-epoch, and from a checkpoint on an epoch end.

One run directory, three launches (each costs ~30-60 s on two cores, so one chain covers the cases)::

    launch 1   1 rank    steps 1-2     8 of epoch 0's 32 groups       final checkpoint (step 2)
    launch 2   2 ranks   steps 3-5     32 of 32: the epoch's end      1 -> 2 mid-epoch; saved on the epoch end
    launch 3   1 rank    steps 6-13    the whole of epoch 1           2 -> 1 from an epoch end

Checked from the trainer's own records (``consumed-rank*.jsonl``, ``metrics.jsonl``): every group of both epochs
trained exactly once across the parts, every step logged once, and every rank of a resumed part trained a full batch
at each of its steps (no rank idle for lack of a shard). 2 -> 1 mid-epoch, 1 -> 2 from an epoch end, bit-exact shards,
routed groups and any resize: tests/integration/test_elastic_resume.py, test_resume_contract.py (its resize rule) and
tests/unit/pool/test_reshard.py.
"""

from __future__ import annotations

import collections

import pytest

from tests.integration.test_recipe import _consumed, _finish, _metrics, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 32 prompts, 4 groups per rank and step: an epoch is 4 steps at 2 ranks, 8 at 1
SMALL = ["data.num_prompts=32", "rollout.batch_size=4", "rollout.group_size=4", "train.sft_steps=10",
         "checkpoint.every=100", "rollout.wait_timeout_s=120", "debug.enabled=false"]


def test_the_recipe_resumes_at_another_number_of_ranks_both_ways_each_group_trained_once(tmp_path):
    run = tmp_path / "run"
    _finish(_torchrun(run, "train.steps=2", *SMALL, nproc=1))
    out = _finish(_torchrun(run, "train.steps=5", *SMALL, nproc=2, resume=True))
    assert "was saved at 1 trainer ranks, this run has 2" in out, out[-3000:]
    out = _finish(_torchrun(run, "train.steps=13", *SMALL, nproc=1, resume=True))
    assert "was saved at 2 trainer ranks, this run has 1" in out, out[-3000:]

    assert [r["step"] for r in _metrics(run)] == list(range(1, 14))
    records = {rank: _consumed(run, rank) for rank in (0, 1)}
    steps = {rank: [r["step"] for r in rows] for rank, rows in records.items()}
    assert steps == {0: list(range(1, 14)), 1: [3, 4, 5]}, steps  # each rank's steps, each once
    groups = collections.Counter(g for rows in records.values() for r in rows for g in r["group_ids"])
    assert set(groups) == {f"e{e}-p{i}" for e in (0, 1) for i in range(32)}
    assert max(groups.values()) == 1, [g for g, n in groups.items() if n > 1]
    for rows in records.values():  # a full batch on every rank at every step: no rank waited for want of a shard
        assert all(len(r["group_ids"]) == 4 for r in rows), rows
    epochs = {r["step"]: {g.split("-")[0] for g in r["group_ids"]} for r in records[0]}
    assert all(epochs[s] == {"e0"} for s in range(1, 6)) and all(epochs[s] == {"e1"} for s in range(6, 14))
