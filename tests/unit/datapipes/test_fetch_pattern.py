"""How the loader tells a loop that fetches batches ahead (Lightning) from one that does not, from the calls alone."""

from __future__ import annotations

import pytest

from datapipes.loader import _FetchPattern


def _run(pattern: _FetchPattern, calls: str) -> None:
    """``f``: a batch fetched; ``u``: an update to a new version; ``r``: the same version again; ``c``: ``commit()``."""
    version = 0
    for call in calls:
        if call == "f":
            pattern.fetched()
        elif call == "u":
            version += 1
            pattern.committed(version)
        elif call == "r":
            pattern.committed(version)
        else:
            pattern.committed()


@pytest.mark.parametrize("prefetch, calls", [
    (0, "fu" * 6),                   # a plain loop
    (0, "ffu" * 4),                  # two batches per update (gradient accumulation)
    (0, "fuu" * 4),                  # two updates per batch (PPO epochs)
    (0, "fur" * 3 + "fuc" * 3),      # repeated calls and commit() train nothing
    (0, "u" + "fu" * 4),             # an update before the first batch (a resumed version announced)
    (1, "ffu" + "fu" * 4 + "u"),     # Lightning: one batch ahead, and at the epoch's end the held one trained
    (1, "fffu" + "ffu" * 3),         # Lightning with two batches per update
])
def test_loops_that_keep_their_declared_prefetch_pass(prefetch, calls):
    _run(_FetchPattern(prefetch, check=True, rank=0), calls)


@pytest.mark.parametrize("calls, ahead", [("ffu" + "fu" * 3, 1), ("fffu" + "fu", 2), ("ffu" + "uu" + "fu", 1)])
def test_a_loop_fetching_further_ahead_than_declared_is_refused_with_the_fix(calls, ahead):
    with pytest.raises(RuntimeError, match=f"fetches {ahead} batch.* ahead.*prefetch={ahead}.*RolloutSync"):
        _run(_FetchPattern(0, check=True, rank=0), calls)
    _run(_FetchPattern(0, check=False, rank=0), calls)  # check_prefetch=False: trusted
    _run(_FetchPattern(ahead, check=True, rank=0), calls)  # declared: fine


def test_a_loaded_state_counts_the_first_fetches_again():
    pattern = _FetchPattern(1, check=True, rank=0)
    _run(pattern, "ffu" + "fu" * 2)
    pattern.restart()
    _run(pattern, "ffu" + "fu")  # after a resume Lightning fetches two before its first update again
