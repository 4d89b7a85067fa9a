"""One trainer step's shared parts at 2 gloo ranks (``_two_rank_step_driver.py``, one torchrun for the module):

* the KL's reference under FSDP2 (``asyncrl.train.reference``): sharded like the policy, frozen, resharded after its
  forward (root included), each rank holding about half of it, with logprobs bit for bit the unsharded copy's;
* the logged ``loss/*`` and ``mismatch/*`` metrics (``asyncrl.train.step_metrics.global_metrics``): the values of the
  whole step, equal to one process computing them on the union of the two ranks' batches (before: rank 0's own),
  and a rank whose metrics have other names fails on both ranks instead of mixing values up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._two_rank_step_driver import CONFIGS, step_metrics, union_batch

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # one torchrun of 2 ranks: ~15 s on 2 idle cores

ROOT = Path(__file__).parents[2]
DRIVER = Path(__file__).with_name("_two_rank_step_driver.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_rank_step")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DRIVER), str(out)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_fsdp2_reference_is_sharded_frozen_and_bit_identical(ranks):
    full = ranks[0]["reference"]["full_numel"]
    for r in ranks:
        ref = r["reference"]
        assert ref["bit_equal"], f"rank {r['rank']}: sharded reference logprobs differ by {ref['max_abs_diff']}"
        assert ref["all_dtensor_after_forward"], "a parameter stayed gathered after the forward (root not resharded?)"
        assert ref["frozen"]
        # 1/world of every parameter, up to FSDP2's padding of dim 0 (at most one row per parameter)
        assert ref["local_numel"] <= full / 2 + ref["largest_param"] / 8, ref
    assert sum(r["reference"]["local_numel"] for r in ranks) == full  # the shards are the whole model, once


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logged_metrics_are_the_union_batchs(ranks, name):
    union = step_metrics(union_batch(), name)  # one process, the whole step's batch
    got = [r["global"][name] for r in ranks]
    assert got[0] == got[1], "the ranks log different values"
    assert list(got[0]) == list(union)
    differ = {k: (got[0][k], v) for k, v in union.items() if got[0][k] != pytest.approx(v, rel=1e-6, abs=1e-9)}
    assert not differ, f"{name}: logged (2 ranks) vs one process on the union: {differ}"
    local = [r["local"][name] for r in ranks]
    # the test means something: the ranks' own values differ, and not only by their counts
    assert local[0]["loss/valid_tokens"] != local[1]["loss/valid_tokens"]
    assert local[0]["mismatch/abs_diff_mean"] != local[1]["mismatch/abs_diff_mean"]
    moved = [k for k in union if k.endswith(("_mean", "_fraction", "/kl", "k3")) and local[0][k] != union[k]]
    assert len(moved) >= 4, moved


def test_differently_named_metrics_fail_on_every_rank(ranks):
    for r in ranks:
        assert r["names_error"] is not None and "different metric names" in r["names_error"], r["names_error"]
