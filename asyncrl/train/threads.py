"""How many intra-op threads a trainer rank gets when it shares the machine's cores with local rollout workers.

On CPU, torch's intra-op threads spin at the end of each parallel region; when the threads of all processes
outnumber the cores, each op's barrier waits for a thread the kernel has descheduled. On a 2-core machine the
recipe's trainer step (1 rank, 2 threads, beside one 1-thread worker) took 0.1-2.3 s instead of 0.04-0.06 s
with 1 thread, and it did so in synchronous mode too, where the worker was mostly idle. The rule: the cores
left after the local workers (``LocalWorkerLauncher`` runs each with ``OMP_NUM_THREADS=1``), divided among
the local trainer ranks, at least 1. Nobody blocks on anything here.
"""

from __future__ import annotations

import os

__all__ = ["trainer_threads"]


def trainer_threads(local_ranks: int, local_workers: int, *, worker_threads: int = 1, cores: int | None = None) -> int:
    """Intra-op threads for each of ``local_ranks`` trainer ranks beside ``local_workers`` workers on this host.

    Args:
        local_ranks: trainer ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``).
        local_workers: rollout worker processes on this host (all ranks together).
        worker_threads: intra-op threads of each worker.
        cores: usable cores (default: this process's CPU affinity).

    Raises:
        ValueError: ``local_ranks`` < 1 or a negative count.
    """
    if local_ranks < 1 or local_workers < 0 or worker_threads < 0:
        raise ValueError(f"need {local_ranks=} >= 1, {local_workers=} >= 0 and {worker_threads=} >= 0")
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, (cores - local_workers * worker_threads) // local_ranks)
