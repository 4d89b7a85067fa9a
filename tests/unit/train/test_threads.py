"""asyncrl.train.threads: trainer ranks get the cores the local workers leave, never fewer than one thread."""

import pytest

from asyncrl.train.threads import trainer_threads


@pytest.mark.parametrize("ranks, workers, cores, want", [
    (1, 1, 2, 1),    # the benchmark's 2-core machine: 1 rank beside 1 worker
    (2, 2, 2, 1),    # make run: 2 ranks, one worker each
    (1, 0, 8, 8),    # remote workers only: every core
    (2, 4, 16, 6),
    (4, 8, 4, 1),    # more processes than cores: still one thread each
])
def test_the_cores_left_after_the_workers_per_rank(ranks, workers, cores, want):
    assert trainer_threads(ranks, workers, cores=cores) == want


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="local_ranks=0"):
        trainer_threads(0, 1)
