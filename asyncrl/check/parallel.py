"""Stage ``parallel``: the split. Under DDP / FSDP2 at each rank count, every tensor is the one-process model's.

    check process:  build_policy (one process) ── digests of every parameter and buffer, logits on a fixed batch
                    for N in ctx.ranks:  launch_ranks(_parallel_ranks, N)
                        rank r:  build_policy, asyncrl.train.parallel.parallelize(ctx.parallel)
                                 full_tensor() of each parameter ── digest ── rank0.json, rank1.json, ...
                                 forward on the same batch ── max |d| vs one process, vs rank 0
                    compare:  a digest that differs names the tensor (max |d|, the first differing row and the
                              rank whose FSDP2 shard holds it); logits over ``parallel.forward_max_abs`` fail

Parameters and buffers must be equal bit for bit (the wrapping moves bytes, it must not change them); the
forward is held to ``parallel.forward_max_abs`` (per-dtype default in :mod:`asyncrl.check.thresholds`; FSDP2's
all-gather and DDP's broadcast give the same bytes, so on CPU the tiny models measure 0). Blocks on the ranks it
launches, one rank count at a time.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.check import CheckContext, StageResult
from asyncrl.check._policy import begin_stage, build_policy, digest, first_difference, fixed_batch, full_tensors

__all__ = ["run"]

TIMEOUT_S = 600.0


def _threshold(ctx: CheckContext) -> float:
    """``parallel.forward_max_abs`` from ``ctx.thresholds``, else the dtype's default."""
    from asyncrl.check.thresholds import DEFAULTS

    return float(ctx.thresholds.get("parallel.forward_max_abs",
                                    DEFAULTS.get(ctx.dtype, DEFAULTS["bfloat16"])["parallel.forward_max_abs"]))


def _reference(ctx: CheckContext, work: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """One process: the digests of every tensor and the logits of the fixed batch (written for the ranks)."""
    from safetensors.torch import save_file

    from asyncrl.train.logprobs import position_ids

    policy = build_policy(ctx.model, dtype=ctx.dtype, lora_rank=ctx.lora_rank, seed=ctx.seed)
    digests = {name: digest(t) for name, t in full_tensors(policy)}
    config = policy.config
    pad = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    batch_spec = {"vocab_size": int(config.vocab_size), "seed": ctx.seed, "pad_token_id": pad}
    batch = fixed_batch(**batch_spec)
    with torch.no_grad():
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=position_ids(batch["attention_mask"])).logits.float()
    save_file({"logits": logits.contiguous()}, str(work / "logits.safetensors"))
    return digests, batch_spec


def _mismatch(name: str, run: Path, reference: torch.nn.Module | None, world: int) -> dict[str, Any]:
    """How a tensor rank 0 gathered differs from the one process's (max |d|, first row, the FSDP2 shard's rank)."""
    from safetensors import safe_open

    path = run / "mismatch.safetensors"
    if reference is None or not path.exists():
        return {}
    with safe_open(str(path), "pt") as f:
        if name not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
            return {}
        got = f.get_tensor(name)
    want = dict(full_tensors(reference))[name]
    found = first_difference(got, want)
    if found.get("first_row", -1) >= 0 and got.dim():
        chunk = math.ceil(got.shape[0] / world)  # FSDP2 splits dim 0 evenly, rank r holding rows [r*chunk, ...)
        found["shard_rank"] = found["first_row"] // chunk
    return found


def _ranks(ctx: CheckContext, n: int, work: Path, digests: dict[str, str], batch: dict[str, Any]) -> tuple[
        list[dict[str, Any]] | None, str]:
    from asyncrl.check._ranks import launch_ranks
    from asyncrl.codec import dumps_json, loads_json

    run = work / f"ranks-{n}"
    run.mkdir(parents=True, exist_ok=True)
    spec = {"model": ctx.model, "dtype": ctx.dtype, "lora_rank": ctx.lora_rank, "seed": ctx.seed,
            "parallel": ctx.parallel, "imports": list(ctx.imports), "out": str(run), "digests": digests,
            "worst": ctx.worst, "batch": batch, "logits": str(work / "logits.safetensors")}
    (run / "spec.json").write_bytes(dumps_json(spec))
    results = launch_ranks(["-m", "asyncrl.check._parallel_ranks", str(run / "spec.json")], n, timeout_s=TIMEOUT_S)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        first = min(failed, key=lambda r: r.returncode == -9)  # the rank that died, not one the launcher ended
        return None, f"rank {first.rank} exited {first.returncode}: {first.tail(1500)}"
    return [loads_json((run / f"rank{r}.json").read_bytes()) for r in range(n)], ""


def run(ctx: CheckContext) -> StageResult:
    """Checks the split at every rank count of ``ctx.ranks`` under ``ctx.parallel`` (see the module docstring)."""
    t0 = time.perf_counter()
    work, skipped = begin_stage(ctx, "parallel")
    if skipped is not None:
        return skipped
    limit = _threshold(ctx)
    digests, batch = _reference(ctx, work)
    offenders: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"tensors": len(digests), "logits_max_abs_limit": limit, "ranks": {}}
    reference = None
    for n in ctx.ranks:
        reports, error = _ranks(ctx, n, work, digests, batch)
        if reports is None:
            offenders.append({"name": f"{ctx.parallel} x{n}", "what": "a rank failed", "error": error})
            metrics["ranks"][str(n)] = {"error": error}
            continue
        differ: dict[str, list[int]] = {}
        for rep in reports:
            missing = sorted(set(digests) - set(rep["digests"]))
            extra = sorted(set(rep["digests"]) - set(digests))
            for name in missing + extra:
                offenders.append({"name": name, "what": f"{ctx.parallel} x{n}, rank {rep['rank']}: "
                                  + ("missing" if name in missing else "not in the one-process model")})
            for name, d in rep["digests"].items():
                if name in digests and d != digests[name]:
                    differ.setdefault(name, []).append(rep["rank"])
        for name, ranks in differ.items():
            if reference is None:
                reference = build_policy(ctx.model, dtype=ctx.dtype, lora_rank=ctx.lora_rank, seed=ctx.seed)
            offenders.append({"name": name, "what": f"{ctx.parallel} x{n}: full tensor differs from one process",
                              "ranks": ranks, **_mismatch(name, work / f"ranks-{n}", reference, n)})
        worst_logits = max(r["logits_max_abs"] for r in reports)
        across = max(r["logits_vs_rank0"] for r in reports)
        metrics["ranks"][str(n)] = {"tensors_differ": len(differ), "logits_max_abs": worst_logits,
                                    "logits_vs_rank0": across}
        if not worst_logits <= limit or not across <= limit:  # NaN fails too
            offenders.append({"name": f"{ctx.parallel} x{n} logits", "what": "forward differs from one process"
                              if not worst_logits <= limit else "forward differs across ranks",
                              "max_abs": max(worst_logits, across), "limit": limit})
    ok = not offenders
    logits = max((m.get("logits_max_abs", math.inf) for m in metrics["ranks"].values()), default=0.0)
    tensor_offenders = sum(1 for o in offenders if "full tensor differs" in o.get("what", ""))
    summary = (f"{ctx.parallel} at {','.join(map(str, ctx.ranks))} ranks: {len(digests)} tensors "
               + ("bit for bit" if not tensor_offenders else f"({tensor_offenders} differ)")
               + f", logits max |d| {logits:.1e} (limit {limit:.0e})")
    offenders.sort(key=lambda o: -o.get("max_abs", math.inf))  # worst first; a failed rank (no number) before all
    return StageResult(stage="parallel", ok=ok, summary=summary, offenders=offenders[: ctx.worst], metrics=metrics,
                       seconds=time.perf_counter() - t0)
