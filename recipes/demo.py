"""The data-plane demo: what ``make run`` runs until the GRPO recipe lands.

Three local rollout workers (deterministic fake engine) serve one trainer loop through ZeroMQ;
the loop consumes padded batches exactly like a DataLoader, bumps the policy version after every
"optimizer step", checkpoints the loader mid-epoch and resumes from that state in a fresh loader.
At the end it checks that every group of the epoch was consumed exactly once and prints counters.

    python recipes/demo.py [--prompts 256] [--workers 3] [--max-staleness 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import torch
from tqdm import tqdm

from asyncrl import FakeEngineConfig, LoaderConfig, RolloutLoader, WorkerConfig


def make_loader(args: argparse.Namespace, prompts: list[dict]) -> RolloutLoader:
    config = LoaderConfig(
        group_size=args.group_size,
        batch_size=args.batch_size,
        max_staleness=args.max_staleness,
        num_workers=args.workers,
        capacity=4 * args.batch_size,
        wait_timeout_s=120,
        worker=WorkerConfig(engine=FakeEngineConfig(max_new_tokens=64, seconds_per_token=args.seconds_per_token)),
    )
    return RolloutLoader(prompts, config)


def train(loader: RolloutLoader, step: int, steps: int | None, seen: collections.Counter, desc: str) -> int:
    """A stand-in training loop: consume, 'step', publish the new policy version."""
    bar = tqdm(desc=desc, unit="batch", total=steps)
    for batch in loader:
        seen.update(batch["group_ids"])
        lag = (step - batch["policy_versions"]).float()
        step += 1
        loader.set_policy_version(step)
        bar.set_postfix(reward=f"{batch['rewards'].mean():.3f}", staleness=f"{lag.mean():.2f}", tokens=batch["num_tokens"])
        bar.update()
        if steps is not None and bar.n >= steps:
            break
    bar.close()
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--seconds-per-token", type=float, default=0.0005)
    args = p.parse_args()
    prompts = [{"text": f"What is {i} + {i % 7}?"} for i in range(args.prompts)]
    seen: collections.Counter[str] = collections.Counter()
    t0 = time.perf_counter()
    ckpt = os.path.join(tempfile.mkdtemp(prefix="asyncrl-demo-"), "loader.pt")

    loader = make_loader(args, prompts)
    half = (args.prompts // args.batch_size) // 2
    step = train(loader, 0, half, seen, "first run")
    torch.save({"loader": loader.state_dict(), "policy_version": step}, ckpt)
    print(f"checkpointed the loader after {half} batches -> {ckpt}; stats: {loader.stats()['pool']}")
    loader.close()

    loader = make_loader(args, prompts)
    state = torch.load(ckpt, weights_only=True)
    loader.load_state_dict(state["loader"])
    train(loader, state["policy_version"], None, seen, "resumed run")
    stats = loader.stats()
    loader.close()

    missing = [f"e0-p{i}" for i in range(args.prompts) if seen[f"e0-p{i}"] == 0]
    twice = [g for g, n in seen.items() if n > 1]
    print(f"epoch done in {time.perf_counter() - t0:.1f} s: {sum(seen.values())} groups consumed, "
          f"{len(missing)} missing, {len(twice)} consumed twice")
    print(f"pool: {stats['pool']}\nledger: {stats['ledger']}")
    if missing or twice:
        raise SystemExit("exactly-once violated")


if __name__ == "__main__":
    main()
