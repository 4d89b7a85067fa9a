"""The drop-in proof: a plain PyTorch loop where the DataLoader became a RolloutLoader.

    python recipes/drop_in.py [--steps 30]

Compared with supervised training, the loop changes in one place — the loader — plus the one thing
RL needs that supervised learning does not: publishing the new weights to the rollout workers.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from asyncrl import EngineConfig, RolloutLoader, WorkerConfig
from asyncrl.config import WeightSyncConfig
from asyncrl.logprobs import token_logprobs
from asyncrl.weights import setup_weight_broadcaster
from workers.tasks import arithmetic_prompts
from workers.tiny_model import build_tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--run-dir", default="runs/drop_in")
args = parser.parse_args()

model_dir = str(build_tiny_model(f"{args.run_dir}/model"))
model = AutoModelForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
weights = setup_weight_broadcaster("shm")
weights.publish(model.state_dict(), version=0)

# was: loader = DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collate)
loader = RolloutLoader(
    arithmetic_prompts(512),
    num_workers=2,
    group_size=8,
    batch_size=8,
    worker=WorkerConfig(
        engine=EngineConfig(type="hf", model=model_dir, max_new_tokens=4),
        reward="workers.rewards:arithmetic_reward",
        weights=WeightSyncConfig(type="shm", address=weights.address),
    ),
)

for step, batch in enumerate(loader, start=1):
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], grad=True)
    rewards = batch["rewards"].view(-1, 8)  # one row per group
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    loss = -(advantages[:, None] * logp)[batch["loss_mask"]].mean()  # REINFORCE; asyncrl.losses has PPO + IS

    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    weights.publish(model.state_dict(), version=step)  # the RL-only line: workers pick up the new policy
    loader.set_policy_version(step)
    print(f"step {step}: loss {loss.item():.4f} reward {batch['rewards'].mean():.3f}")
    if step == args.steps:
        break

loader.close()
weights.close()
