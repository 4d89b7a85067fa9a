"""Driver for test_two_rank_step, launched with ``torchrun --nproc-per-node 2`` (gloo, CPU).

Each rank (1) loads the KL's reference with ``parallel="fsdp2"`` through ``ReferencePolicy.for_run``, as the recipe
does, and an unsharded copy next to it, and compares their logprobs on its own half of a batch bit for bit and what
each holds; (2) computes the loss and mismatch metrics of its half of a fixed union batch (:func:`union_batch`) and
combines them with :func:`asyncrl.train.step_metrics.global_metrics`, for three loss settings; (3) offers metrics named
differently from the other rank's and records the error. Each rank writes its report to ``rank{r}.json``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 _two_rank_step_driver.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config import LossConfig
from asyncrl.train.corrections import mismatch_metrics
from asyncrl.train.losses import all_reduce_sum, compute_loss, policy_loss

ROWS, LENGTH, GROUP = 16, 12, 2
CONFIGS = {
    "dapo_kl_tis_gap_truncated": {"loss_type": "dapo", "beta": 0.05, "correction": "tis", "max_version_gap": 1,
                                  "mask_truncated_completions": True},
    "grpo_offpolicy_mis": {"loss_type": "grpo", "correction": "mis", "epsilon_high": 0.28},
    "vespo_offpolicy": {"loss_type": "vespo", "correction": "tis"},
}
"""Loss settings whose metrics are compared: each exercises other denominators (KL and masked fractions; clip
ratios of an off-policy ``old``; VESPO's per-sequence weight)."""


def union_batch() -> dict:
    """The whole step's batch: 8 groups of 2 rows, rank ``r`` holds rows ``8r .. 8r + 7``; response lengths, the
    rollout's drift, versions, truncations and a few non-finite logprobs differ between the two halves."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 3, 7, 1, 9, 12, 4, 6, 2, 2, 5, 11, 12, 8, 1, 3])
    prompt = torch.tensor([3, 2, 2, 4, 1, 3, 2, 2, 3, 3, 1, 2, 4, 2, 3, 1])
    pos = torch.arange(LENGTH)
    mask = (pos >= prompt[:, None]) & (pos < (prompt + lengths).clamp(max=LENGTH)[:, None])
    logprobs = -torch.rand(ROWS, LENGTH, generator=gen) * 3 - 0.05
    logprobs[2, 4] = logprobs[11, 6] = -math.inf  # outside top-k: the non-finite fractions count them
    drift = torch.randn(ROWS, LENGTH, generator=gen) * torch.linspace(0.05, 0.8, ROWS)[:, None]
    return {
        "logprobs": logprobs,
        "old_logprobs": logprobs + torch.randn(ROWS, LENGTH, generator=gen) * 0.3,
        "rollout_logprobs": logprobs - drift,
        "ref_logprobs": logprobs + torch.randn(ROWS, LENGTH, generator=gen) * 0.5,
        "rewards": torch.randint(0, 3, (ROWS,), generator=gen).float(),
        "group_index": torch.arange(ROWS) // GROUP,
        "loss_mask": mask,
        "token_versions": torch.randint(3, 6, (ROWS, LENGTH), generator=gen),
        "finish_reasons": ["length" if i in (1, 5, 6, 12) else "stop" for i in range(ROWS)],
        "reward_components": {},
    }


def rows(batch: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s rows of ``batch`` (whole groups)."""
    per = ROWS // world
    pick = slice(rank * per, (rank + 1) * per)
    return {k: v[pick] if isinstance(v, (torch.Tensor, list)) else v for k, v in batch.items()}


def step_metrics(batch: dict, name: str, all_reduce=None) -> dict[str, float]:
    """What the recipe logs of ``batch`` under ``CONFIGS[name]``, before any reduction over ranks: ``compute_loss``'s
    metrics (on-policy, as the recipe: ``old`` = the logprobs) for the first setting, ``policy_loss``'s with the
    batch's off-policy ``old_logprobs`` for the others, and ``mismatch_metrics``, as ``loss/*`` and ``mismatch/*``."""
    config = LossConfig(**CONFIGS[name])
    lp = batch["logprobs"].clone().requires_grad_(True)
    ref = batch["ref_logprobs"] if config.beta > 0 else None
    if name == "dapo_kl_tis_gap_truncated":
        _, loss_metrics, _ = compute_loss(batch, lp, config=config, trainer_version=6, ref_logprobs=ref,
                                          all_reduce=all_reduce)
    else:
        from asyncrl.train.advantages import compute_advantages

        adv = compute_advantages(batch["rewards"], batch["group_index"], scale_rewards="group")
        _, loss_metrics = policy_loss(lp, batch["old_logprobs"], batch["rollout_logprobs"], adv, batch["loss_mask"],
                                      config=config, all_reduce=all_reduce)
    mismatch = mismatch_metrics(batch["logprobs"], batch["rollout_logprobs"], batch["loss_mask"])
    return {**{f"loss/{k}": v for k, v in loss_metrics.items()}, **{f"mismatch/{k}": v for k, v in mismatch.items()}}


def reference_report(out: Path, rank: int) -> dict:
    from torch.distributed.tensor import DTensor

    from asyncrl.testing.tiny_model import build_tiny_model
    from asyncrl.train.reference import ReferencePolicy

    model_dir = out / "model"
    if rank == 0:
        build_tiny_model(model_dir)
    dist.barrier()
    sharded = ReferencePolicy.for_run(None, None, model_dir=model_dir, run_dir=out, lora=False, warmed=False,
                                      fresh=True, parallel="fsdp2")
    whole = ReferencePolicy.load(model_dir)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, of its own length
    ids = torch.randint(1, 100, (3, 9 + 4 * rank), generator=gen)
    attn = torch.ones_like(ids, dtype=torch.bool)
    attn[1, -3:] = False
    sampling = {"temperature": 0.9, "top_k": 0, "top_p": 1.0}
    got, expected = sharded.logprobs(ids, attn, **sampling), whole.logprobs(ids, attn, **sampling)
    params = dict(sharded.model.named_parameters())
    return {
        "bit_equal": bool(torch.equal(got.view(torch.int32), expected.view(torch.int32))),
        "max_abs_diff": float((got - expected).nan_to_num(posinf=0, neginf=0).abs().max()),
        "all_dtensor_after_forward": all(isinstance(p, DTensor) for p in params.values()),
        "frozen": not any(p.requires_grad for p in params.values()) and not sharded.model.training,
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "full_numel": sum(p.numel() for p in whole.model.parameters()),
        "largest_param": max(p.numel() for p in whole.model.parameters()),
    }


def main(out_dir: str) -> None:
    from asyncrl.train.step_metrics import global_metrics

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    report = {"rank": rank, "world": world, "reference": reference_report(out, rank), "local": {}, "global": {}}
    mine = rows(union_batch(), rank, world)
    for name in CONFIGS:
        local = step_metrics(mine, name, all_reduce=all_reduce_sum)
        report["local"][name] = local
        report["global"][name] = global_metrics(local, torch.device("cpu"))
    try:
        global_metrics({"loss/loss": 1.0, **({"loss/extra": 2.0} if rank == 1 else {})}, torch.device("cpu"))
        report["names_error"] = None
    except ValueError as e:
        report["names_error"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
