"""Driver for test_exactly_once: one trainer process of a two-process run.

``first``: consume part of the epoch with 3 local workers, SIGKILL one worker, checkpoint the
loader, consume a little more (work the crash will lose), then SIGKILL this trainer process.
``resume``: a new process loads the checkpoint and consumes the rest of the epoch.
``--streaming``: the workers run the streaming loop (the killed one dies with requests in its engine).
Each phase records the group ids it consumed up to the point that counts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, TransportConfig, WorkerConfig


def make_loader(num_prompts: int, streaming: bool = False) -> RolloutLoader:
    config = LoaderConfig(
        group_size=4,
        batch_size=8,
        capacity=32,
        max_staleness=1,
        num_workers=3,
        lease_timeout_s=30,
        wait_timeout_s=120,
        poll_timeout_s=0.2,
        transport=TransportConfig(heartbeat_s=0.2, peer_timeout_s=2.0, handshake_timeout_s=60),
        worker=WorkerConfig(slots=2, max_batch=2, streaming=streaming,
                            engine=FakeEngineConfig(max_new_tokens=24, seconds_per_token=0.002)),
    )
    prompts = [{"prompt_ids": [i % 250 + 1, 7, 9]} for i in range(num_prompts)]
    return RolloutLoader(prompts, config)


def write_json(path: str, obj: object) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def first(args: argparse.Namespace) -> None:
    loader = make_loader(args.prompts, args.streaming)
    write_json(os.path.join(args.dir, "worker_pids_first.json"), loader.launcher.pids)
    consumed: list[str] = []
    version = 0
    for step, batch in enumerate(loader):
        consumed += batch["group_ids"]
        version += 1
        loader.set_policy_version(version)
        if step == 5:
            loader.launcher.kill(0)  # a worker crash mid-run
        if step == args.checkpoint_at:
            state = loader.state_dict()
            tmp = os.path.join(args.dir, "ckpt.pt.tmp")
            torch.save({"loader": state, "policy_version": version}, tmp)
            os.replace(tmp, os.path.join(args.dir, "ckpt.pt"))
            write_json(os.path.join(args.dir, "consumed_first.json"), consumed)
        if step == args.checkpoint_at + 4:
            write_json(os.path.join(args.dir, "stats_first.json"), loader.stats())
            write_json(os.path.join(args.dir, "worker_pids_first.json"), loader.launcher.pids)
            os.kill(os.getpid(), signal.SIGKILL)  # the trainer crashes; its workers notice and exit
    sys.exit("epoch ended before the simulated crash")


def resume(args: argparse.Namespace) -> None:
    state = torch.load(os.path.join(args.dir, "ckpt.pt"), weights_only=True)
    loader = make_loader(args.prompts, args.streaming)
    write_json(os.path.join(args.dir, "worker_pids_resume.json"), loader.launcher.pids)
    loader.load_state_dict(state["loader"])
    version = state["policy_version"]
    consumed: list[str] = []
    for batch in loader:
        consumed += batch["group_ids"]
        assert int(batch["policy_versions"].min()) >= version - 1, "staleness bound violated"
        version += 1
        loader.set_policy_version(version)
    write_json(os.path.join(args.dir, "consumed_resume.json"), consumed)
    write_json(os.path.join(args.dir, "stats_resume.json"), loader.stats())
    loader.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["first", "resume"])
    p.add_argument("--dir", required=True)
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--checkpoint-at", type=int, default=30)
    p.add_argument("--streaming", action="store_true", help="streaming workers (worker.streaming)")
    a = p.parse_args()
    first(a) if a.phase == "first" else resume(a)
