"""One trainer rank of the ``logprobs`` stage (private; launched by :func:`asyncrl.check._ranks.launch_ranks`).

    every rank: init_process_group("gloo") → the policy (model dir [+ LoRA], then --state) → parallelize (ddp|fsdp2)
                → asyncrl.debug.align.compare on the engine's rollouts (--groups) → OUT/rank-{r}.json
    (FSDP2: every forward is a collective, so every rank compares every group, in the same order)

Runs unchanged under ``torchrun --nproc-per-node N -m asyncrl.check._logprob_rank ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.check._logprob_rank")
    for name in ("--model", "--dtype", "--parallel", "--state", "--groups", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--lora", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--worst", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qlora", action="store_true")
    p.add_argument("--import", dest="imports", action="append", default=[])
    a = p.parse_args(argv)
    import torch.distributed as dist
    from safetensors.torch import load_file

    from asyncrl.check import CheckContext
    from asyncrl.check._chain import load_trainer_policy
    from asyncrl.check.logprobs import token_metrics
    from asyncrl.codec import dumps_json
    from asyncrl.debug.dump import read_dump
    from asyncrl.rollout import Group
    from asyncrl.train.parallel import parallelize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctx = CheckContext(model=a.model, dtype=a.dtype, lora_rank=a.lora, qlora=a.qlora, seed=a.seed,
                       temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, worst=a.worst, imports=a.imports)
    policy = load_trainer_policy(ctx)
    trained = load_file(a.state)  # the trainable parameters (all of them, or the adapter)
    result = policy.load_state_dict(trained, strict=False)
    missing = {n for n, q in policy.named_parameters() if q.requires_grad} - set(trained)
    if result.unexpected_keys or missing:
        raise ValueError(f"trained state does not fit the policy: unexpected {result.unexpected_keys[:8]}, "
                         f"missing {sorted(missing)[:8]}")
    model = parallelize(policy, a.parallel, torch.device("cpu")).eval()
    _, body = read_dump(a.groups)
    groups = [Group.from_wire(g) for g in body["groups"]]
    metrics = token_metrics(model, groups, ctx)
    Path(a.out, f"rank-{rank}.json").write_bytes(dumps_json(metrics))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
