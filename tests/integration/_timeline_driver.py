"""Driver for test_timeline_rollback: one trainer incarnation of a run whose trainer crashes and resumes.

The trainer binds its pool at a fixed ``--port`` (remote workers connect to it) and publishes weights to a
shared-memory directory shared by both incarnations (as the recipe does: one directory per run). The worker
is started by the test and outlives the first incarnation.

``first``: versions 1..``--crash-at`` (one consumed batch each, weights published at every version), the
loader checkpointed at ``--checkpoint-at``; then it waits to be SIGKILLed.
``resume``: a new incarnation loads the checkpoint (version ``--checkpoint-at``), publishes that version's
weights and consumes the rest of the epoch, recording each batch and the pool's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch

from asyncrl import LoaderConfig, RolloutLoader, TransportConfig
from asyncrl.weights import setup_weight_broadcaster


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(version))}


def make(args: argparse.Namespace, fresh: bool):
    directory = os.path.join(args.dir, "weights")
    if fresh:
        shutil.rmtree(directory, ignore_errors=True)  # a run's weights directory is replaced by its resume
    os.makedirs(directory, exist_ok=True)
    broadcaster = setup_weight_broadcaster("shm", directory=directory)
    config = LoaderConfig(group_size=2, batch_size=4, capacity=16, max_staleness=1, num_workers=0,
                          lease_timeout_s=30, wait_timeout_s=120, poll_timeout_s=0.2,
                          transport=TransportConfig(bind=f"tcp://127.0.0.1:{args.port}", heartbeat_s=0.2,
                                                    peer_timeout_s=30.0))
    loader = RolloutLoader([{"prompt_ids": [i % 200 + 1, 3]} for i in range(args.prompts)], config)
    return broadcaster, loader


def write_json(path: str, obj: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def first(args: argparse.Namespace) -> None:
    broadcaster, loader = make(args, fresh=True)
    broadcaster.publish(weights(0), 0, incarnation=loader.incarnation)
    version = 0
    for batch in loader:
        version += 1
        loader.set_policy_version(version)
        broadcaster.publish(weights(version), version, incarnation=loader.incarnation)
        if version == args.checkpoint_at:
            torch.save({"loader": loader.state_dict(), "version": version}, os.path.join(args.dir, "ckpt.pt"))
        if version == args.crash_at:
            break
    # wait until the worker runs the dead incarnation's newest weights, then crash (the test SIGKILLs us)
    write_json(os.path.join(args.dir, "first.json"), {"incarnation": loader.incarnation, "version": version})
    time.sleep(3600)


def resume(args: argparse.Namespace) -> None:
    state = torch.load(os.path.join(args.dir, "ckpt.pt"), weights_only=True)
    broadcaster, loader = make(args, fresh=True)
    loader.load_state_dict(state["loader"])
    version = state["version"]
    loader.set_policy_version(version)
    broadcaster.publish(weights(version), version, incarnation=loader.incarnation)
    batches = []
    for batch in loader:
        batches.append({"version": version, "group_ids": batch["group_ids"],
                        "policy_versions": batch["policy_versions"].tolist()})
        version += 1
        loader.set_policy_version(version)
        broadcaster.publish(weights(version), version, incarnation=loader.incarnation)
    write_json(os.path.join(args.dir, "resume.json"), {"incarnation": loader.incarnation, "batches": batches,
                                                       "stats": loader.stats()})
    loader.close()
    broadcaster.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["first", "resume"])
    p.add_argument("--dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--checkpoint-at", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=6)
    a = p.parse_args()
    first(a) if a.phase == "first" else resume(a)
