"""Driver for test_multirank, launched with ``torchrun --nproc-per-node 2``.

Each rank binds its own pool and owns its shard of the ledger; the ranks exchange endpoints over a
gloo process group and each starts one local worker that serves both ranks (M:N). Each rank
consumes half its shard, checkpoints its loader, and finishes the epoch in a new loader restored
from that state. Rank 0 writes what every rank consumed.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig

NUM_PROMPTS = 96


def make_loader() -> RolloutLoader:
    config = LoaderConfig(
        group_size=2,
        batch_size=4,
        capacity=16,
        num_workers=1,
        drop_remainder=True,
        max_staleness=None,
        wait_timeout_s=120,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=10),
        worker=WorkerConfig(slots=2, max_batch=2, engine=FakeEngineConfig(max_new_tokens=16, seconds_per_token=0.001)),
    )
    prompts = [{"prompt_ids": list(range(1, 2 + i % 13))} for i in range(NUM_PROMPTS)]
    return RolloutLoader(prompts, config, prompt_lengths=[1 + i % 13 for i in range(NUM_PROMPTS)])


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = make_loader()
    assert len(loader.endpoints) == 2 and loader.endpoints[rank] == loader.endpoint
    consumed, workers, steps = [], set(), 0
    it = iter(loader)
    for batch in it:
        consumed += batch["group_ids"]
        workers |= set(batch["worker_ids"])
        steps += 1
        if steps == 5:
            break
    state = loader.state_dict()
    loader.close()
    dist.barrier()
    resumed = make_loader()
    resumed.load_state_dict(state)
    for batch in resumed:
        consumed += batch["group_ids"]
        workers |= set(batch["worker_ids"])
        steps += 1
    resumed.close()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "consumed": consumed, "workers": sorted(workers), "steps": steps})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
