"""Stage ``weight_sync``: publish → the engine applies → the engine's own checksums equal the trainer's, every tensor.

    trainer (this process)                               engine process (asyncrl.check._engine)
    expected = tensor_checksum(t) for the published tensors (full state dict, or the LoRA adapter)
    broadcaster.publish(policy_state(policy), v)  ══shm══► receive, verify buckets, apply_weights, commit
    actual   = engine.weight_checksums(mode, names)  ◄──── computed from the engine's own parameters (vLLM:
                                                            fused qkv_proj / gate_up_proj sliced back)
    compare, twice: version 1 (the model directory's weights) and version 2 (after one AdamW step on the
    engine's own rollouts: every trained tensor must have changed, and the engine must hold the new values)

What fails, named per tensor: a tensor the engine holds with other bytes (a fused shard in the wrong order,
a tied embedding not updated, an engine one update behind, an adapter ignored: vLLM's adapter is read back
from its LoRA layers at the adapter's slot), a tensor it does not hold at all (missing), and — counted, not
failed — a tensor it cannot read back (unverifiable: a tensor-parallel shard; vLLM's ``lora_B`` when the
adapter's scaling, folded into it at load, is not a power of two). The worker's own post-sync verification
(:class:`~asyncrl.weights.verify.WeightVerifier` in full mode, staged tensors against the engine) runs on
every apply and is reported alongside. The expected checksums are the trainer's own tensors, not the
received copies, so a transfer that changed a tensor consistently would fail here too.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from asyncrl.check import CheckContext, StageResult
from asyncrl.check._chain import check_prompts, shared_chain

__all__ = ["run"]


def _compare(expected: dict[str, torch.Tensor], actual: dict[str, Any], phase: str) -> tuple[list[dict], list[str]]:
    """Offenders (differs / missing) and the names the engine could not read."""
    from asyncrl.weights.verify import tensor_checksum

    offenders, unverifiable = [], []
    for name, t in expected.items():
        got = actual.get(name, "missing")
        if got is None:
            unverifiable.append(name)
        elif got == "missing":
            offenders.append({"name": name, "what": "missing at the engine", "phase": phase,
                              "shape": list(t.shape)})
        else:
            dtype, checksum = got
            want = tensor_checksum(t if dtype == str(t.dtype).removeprefix("torch.") else t.to(getattr(torch, dtype)))
            if want != checksum:
                offenders.append({"name": name, "what": "engine differs", "phase": phase, "numel": t.numel(),
                                  "trainer_checksum": f"{want:016x}", "engine_checksum": f"{checksum:016x}"})
    return offenders, unverifiable


def run(ctx: CheckContext) -> StageResult:
    t0 = time.perf_counter()
    metrics: dict[str, Any] = {"mode": "lora" if ctx.lora_rank else "full", "engine": ctx.engine_class or ctx.engine,
                               "transport": "shm", "phases": {}}
    offenders: list[dict[str, Any]] = []
    chain = shared_chain(ctx)
    before: dict[str, torch.Tensor] = {}
    for phase in ("before step", "after step"):
        if phase == "after step":
            groups = chain.engine.generate(check_prompts(ctx), ctx.samples)
            metrics["loss"] = chain.step(groups)
        expected = chain.published()
        applied = chain.publish()
        actual = chain.engine.checksums(chain.mode, sorted(expected))
        found, unverifiable = _compare(expected, actual, phase)
        offenders += found
        info = {"version": chain.version, "tensors": len(expected), "differ": len(found),
                "unverifiable": len(unverifiable), "worker_verify_mismatched": applied["mismatched"],
                "worker_verify_unverifiable": len(applied["unverifiable"])}
        if before:
            unchanged = [n for n, t in expected.items() if n in before and torch.equal(before[n], t)]
            info["unchanged_by_step"] = len(unchanged)
            trainable = {n for n in expected if chain.mode == "lora" or not n.endswith("rotary_emb.inv_freq")}
            if len(unchanged) == len(trainable):
                offenders.append({"name": "optimizer step", "what": "changed no published tensor: the after-step "
                                  "check would be vacuous", "tensors": len(expected)})
        metrics["phases"][phase] = info
        before = expected
    phases = metrics["phases"]
    unverifiable = max(p["unverifiable"] for p in phases.values())
    n = phases["before step"]["tensors"]
    summary = (f"{n} {metrics['mode']} tensors x 2 versions (before/after a step): "
               f"{sum(p['differ'] for p in phases.values())} differ")
    if unverifiable:
        summary += (f", {unverifiable} unverifiable (the engine cannot read them back: "
                    "covered by the logprobs stage)")
    return StageResult(stage="weight_sync", ok=not offenders, summary=summary, offenders=offenders[: ctx.worst],
                       metrics=metrics, seconds=time.perf_counter() - t0)
