"""The drop-in proof: a plain PyTorch loop where the DataLoader became a RolloutLoader.

    python recipes/drop_in.py [--steps 30] [--run-dir runs/drop_in]
    python recipes/drop_in.py --resume            # continues from run_dir/checkpoints/latest

Compared with supervised training the loop changes in one place, the loader, plus what RL needs that
supervised learning does not; each is one line from the library, and the loop keeps the guarantees the
recipe has:

- ``PolicySync.commit``: the new weights reach the rollout workers and the pool's policy version moves, in
  the right order (a loop cannot forget either);
- ``UpdateGuard.step``: backward + optimizer step, rejected (and undone exactly) on a non-finite loss or
  gradient or an update too large;
- ``Checkpointer``: atomic checkpoints with the loader's state, so a killed run resumes and trains every
  prompt exactly once (``hold_run_dir``: one run per directory; ``continue_records``: the records of the
  rolled-back steps are dropped on resume).
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from asyncrl import (
    Checkpointer,
    GuardConfig,
    HFEngineConfig,
    PolicySync,
    RolloutLoader,
    UpdateGuard,
    WeightSyncConfig,
    WorkerConfig,
    batch_logprobs,
    continue_records,
    hold_run_dir,
    setup_weight_broadcaster,
)
from asyncrl.data.tasks import arithmetic_prompts
from asyncrl.testing.tiny_model import build_tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--run-dir", default="runs/drop_in")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--prompts", type=int, default=512)
parser.add_argument("--group-size", type=int, default=8)
parser.add_argument("--checkpoint-every", type=int, default=10)
parser.add_argument("--kill-after-step", type=int, default=None, help="fault injection for tests: SIGKILL itself")
args = parser.parse_args()
run_dir = Path(args.run_dir)
lock = hold_run_dir(run_dir)  # a second run on this directory is refused, naming this one

model_dir = run_dir / "model"
if not (model_dir / "config.json").exists():
    build_tiny_model(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
guard = UpdateGuard(model, optimizer, GuardConfig(max_update_ratio=0.05), grad_clip=1.0)
checkpointer = Checkpointer(run_dir / "checkpoints", model, optimizer, keep=2)
latest = checkpointer.resolve() if args.resume else None
resumed = checkpointer.load(latest) if latest is not None else None  # model, optimizer, RNG
step = resumed.step if resumed else 0
continue_records([run_dir / "consumed.jsonl"], step)
weights = setup_weight_broadcaster("shm", directory=run_dir / "weights")

# was: loader = DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collate)
loader = RolloutLoader(
    arithmetic_prompts(args.prompts),
    num_workers=2,
    group_size=args.group_size,
    batch_size=8,
    drop_remainder=True,
    worker=WorkerConfig(
        engine=HFEngineConfig(model=str(model_dir), max_new_tokens=4),
        reward="arithmetic",
        weights=WeightSyncConfig(type="shm", address=weights.address),
    ),
)
checkpointer.loader = loader
if latest is not None:
    checkpointer.load_loader(latest)  # leases, buffered rollouts, what was consumed
sync = PolicySync(model, loader, weights, version=resumed.policy_version if resumed else 0)  # publishes it

records = open(run_dir / "consumed.jsonl", "a")
for batch in loader:
    step += 1
    logp = batch_logprobs(model, batch, grad=True)  # under the temperature/top-k/top-p the rollouts were sampled with
    rewards = batch["rewards"].view(-1, args.group_size)  # one row per group
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    loss = -(advantages[:, None] * logp)[batch["loss_mask"]].mean()  # REINFORCE; asyncrl.train has the GRPO family

    verdict = guard.step(loss)  # backward, clip, step; undone exactly if rejected
    sync.commit(verdict.accepted)  # the RL-only line: the pool's version moves, workers get the new policy

    records.write(json.dumps({"step": step, "group_ids": batch["group_ids"]}) + "\n")
    records.flush()
    print(f"step {step}: loss {loss.item():.4f} reward {batch['rewards'].mean():.3f} "
          f"{'accepted' if verdict else 'rejected: ' + verdict.reason}", flush=True)
    if step % args.checkpoint_every == 0 or step == args.steps:
        checkpointer.save(step, sync.policy_version)
    if step == args.kill_after_step:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash after the step, its checkpoint possibly behind it
    if step >= args.steps:
        break

records.close()
loader.close()
weights.close()
lock.release()
